"""Memory read bandwidth, measured as a bench run starts and as it ends, and the plain-decoding limit it implies.

Plain decoding reads every weight of the main model once per step, so at batch b it cannot beat
b x bandwidth / weight bytes tokens per second; speculation emits several tokens per read.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch

PROBE_BYTES = 1 << 30  # far larger than any cache


def read_bandwidth_gb_s(threads: int = 0, repeats: int = 5) -> float:
    """GB/s (1e9 bytes) of the best of `repeats` sums over a 1 GiB float32 tensor, on `threads` torch threads."""
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        data = torch.ones(PROBE_BYTES // 4)
        data.sum()
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            data.sum()
            best = min(best, time.perf_counter() - start)
        return PROBE_BYTES / best / 1e9
    finally:
        torch.set_num_threads(previous)


def measure_in_subprocess(threads: int = 0) -> float | None:
    """read_bandwidth_gb_s in a process of its own: the 1 GiB probe must not raise the bench process's peak RSS,
    which every cell it starts inherits (a spawned child's ru_maxrss starts at its parent's high-water mark)."""
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    code = ("import json; from compiled_spec.benchmarks.bandwidth import read_bandwidth_gb_s; "
            f"print(json.dumps(read_bandwidth_gb_s({threads})))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    return json.loads(result.stdout) if result.returncode == 0 else None


def limit_bandwidth(readings: dict[str, float | None]) -> float | None:
    """The bandwidth the plain-decoding limit uses: the highest reading. A probe that shares the machine with other
    work reads low (docs/benchmarks.md), and a low limit flatters every cell."""
    found = [value for value in readings.values() if value]
    return max(found) if found else None


def plain_cells_over_limit(records: list[dict]) -> list[str]:
    """Engine cells that decode plainly (k=0) yet beat the plain-decoding limit: the probe read below what plain
    decoding reached, so the limit is not one for this run."""
    return [r["name"] for r in records if r.get("status") == "ok" and r.get("kind") == "engine"
            and r.get("num_speculative_tokens") == 0 and r.get("speedup_vs", {}).get("plain-limit", 0) > 1]


def main_weight_bytes(model) -> int:
    """Bytes of weights a plain decoding step reads: the main model's, the LM head once, one embedding row."""
    total = 0
    for name, tensor in model.state_dict().items():
        if name.startswith("mtp.") or name.startswith("draft_"):
            continue
        if name == "embed_tokens.weight" and model.lm_head is not None:
            continue  # an untied embedding is read one row per token
        total += tensor.numel() * tensor.element_size()
    return total
