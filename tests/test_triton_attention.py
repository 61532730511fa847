"""The CUDA attention kernel of the fused HiSparse op, run in Triton's interpreter on this CPU.

The interpreter must be chosen before triton is imported, so the kernel runs in a child process
(tests/triton_interpreted.py); this test compares what it computed with the CPU implementation of the
same op on the same inputs. On a GPU, tests/test_cuda_graphs.py runs the compiled kernel itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from compiled_spec.hisparse.fused import _attend_rows_cpu, hisparse_attention  # noqa: E402
from compiled_spec.hisparse.reference import sparse_attention  # noqa: E402

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    out = tmp_path_factory.mktemp("triton") / "cases.pt"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, str(HERE / "triton_interpreted.py"), str(out)], env=env, check=True, timeout=600)
    return torch.load(out)


def test_the_op_with_the_triton_kernel_equals_the_cpu_op_and_the_reference(interpreted):
    assert len(interpreted["op"]) == 6
    for args, triton_result in interpreted["op"]:
        cpu_result, reference = hisparse_attention(*args), sparse_attention(*args)
        torch.testing.assert_close(triton_result[0], cpu_result[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(triton_result[0], reference[0], rtol=1e-5, atol=1e-5)
        assert all(torch.equal(a, b) for a, b in zip(triton_result[1:], cpu_result[1:]))


def test_the_kernel_reads_both_tiers_over_many_blocks_and_zeroes_unreadable_queries(interpreted):
    (args, triton_out), = interpreted["attention"]
    hot_read, valid = args[5], args[7]
    assert (hot_read >= 0).any() and (hot_read < 0).any() and args[3].dtype == torch.bfloat16
    assert hot_read.shape[1] > 128 and args[0].shape[-1] == 12  # three key blocks, a head size padded to 16
    expected = _attend_rows_cpu(*args)
    torch.testing.assert_close(triton_out, expected, rtol=1e-5, atol=1e-5)
    assert not valid[-1].any() and torch.equal(triton_out[0, -1], torch.zeros_like(triton_out[0, -1]))
    assert triton_out[0, :-1].abs().sum(-1).min() > 0
