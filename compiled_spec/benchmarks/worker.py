"""Runs one cell in a fresh process, so its compile time, compiled state and peak memory are its own.

    python -m compiled_spec.benchmarks.worker SPEC.json RESULT.json
"""

from __future__ import annotations

import json
import resource
import sys
import time
import traceback


def run_cell(spec: dict) -> dict:
    import torch

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    if spec["kind"] == "engine":
        from .engine_cell import measure_engine as measure
    else:
        from .anchors import measure_anchor as measure
    return {**measure(spec), "threads": torch.get_num_threads()}


def main(spec_path: str, result_path: str) -> None:
    from .unavailable import Unavailable

    spec = json.loads(open(spec_path).read())
    start = time.perf_counter()
    try:
        record = {"status": "ok", **run_cell(spec)}
    except Unavailable as reason:
        record = {"status": "unavailable", "reason": str(reason)}
    except Exception as error:  # recorded in the results; the sweep goes on with the next cell
        traceback.print_exc()
        record = {"status": "error", "reason": f"{type(error).__name__}: {error}"}
    record["cell_s"] = time.perf_counter() - start
    record["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    with open(result_path, "w") as out:
        json.dump(record, out)


if __name__ == "__main__":
    main(*sys.argv[1:3])
