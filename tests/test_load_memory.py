"""What loading SmolLM2-135M's Q4_1 GGUF leaves in memory: the packed weights (a little over the file's blocks: float32
scales where the file has float16 ones) and the float16 draft modules, not float copies, the file's pages or the
repack's temporaries.

Measured in a fresh process as growth of RssAnon (/proc/self/status), the process's anonymous memory: what the engine
holds privately. File-backed pages (the GGUF and safetensors memmaps while they are read, shared libraries) are
page cache the kernel reclaims and other processes share; RSS counts them too, so the test also checks that no map
of the model file outlives the load. Imports and the CPU kernels are loaded before the first reading, so the growth is
the load's alone."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from compiled_spec import fetch_model

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
ALLOWANCE = 1.3  # times the file's tensor bytes (packed scales are float32, the file's float16), plus the drafts

MEASURE = r"""
import gc, json, sys
import gguf, torch
from compiled_spec.loading import checkpoint, registry
from compiled_spec.model import cpu_kernels

def memory():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {key: int(fields[key].split()[0]) * 1024 for key in ("VmRSS", "RssAnon", "RssFile")}

path = registry.fetch_model("smollm2-135m")
mtp = registry.shipped_mtp_modules(path)
tensor_bytes = sum(int(tensor.n_bytes) for tensor in gguf.GGUFReader(str(path)).tensors)
cpu_kernels.load()
# The model is made on the meta device, whose random init runs torch's Python reference ops; their first call imports
# Dynamo (tens of MB of modules, once per process): not memory the loaded weights hold.
import torch._dynamo
gc.collect()
checkpoint.release_freed_memory()
before = memory()
model = checkpoint.load_model(path, mtp=mtp, draft_vocab_size=8192, draft_dtype=torch.float16)
after = memory()
held = dict(model.named_parameters())
held.update((name, tensor) for name, tensor in model.named_buffers() if tensor is not None)
maps = open("/proc/self/maps").read()
print(json.dumps({
    "tensor_bytes": tensor_bytes,
    "draft_bytes": sum(t.nbytes for name, t in held.items() if name.startswith(("mtp.", "draft_"))),
    "weight_bytes": sum(t.nbytes for t in held.values()),
    "growth": {key: after[key] - before[key] for key in before},
    "file_still_mapped": str(path.resolve()) in maps,
}))
"""


def test_loading_smollm2_holds_the_packed_weights_and_little_else():
    fetch_model("smollm2-135m")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", MEASURE], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout.splitlines()[-1])
    bound = ALLOWANCE * found["tensor_bytes"] + found["draft_bytes"]
    assert found["weight_bytes"] <= bound, found  # what the model holds fits, or the bound could not be met
    assert found["growth"]["RssAnon"] <= bound, (found, bound)
    assert not found["file_still_mapped"], found
