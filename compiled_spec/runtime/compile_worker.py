"""The child of a tiered start (runtime/background_compile.py): reads its job (pickled) from stdin, builds the same
engine in full and compiles each graph's package into the shared folder."""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path


def main() -> int:
    job = pickle.load(sys.stdin.buffer)
    pid_file = Path(job["pid_file"])  # the parent wrote this process's pid into it
    try:
        os.nice(10)  # the engine that started this one decodes meanwhile
        import torch

        torch.set_num_threads(job["threads"])  # the thread count is part of every package's key
        from compiled_spec.api import LLM

        llm = LLM(**job["llm"], graph_mode="full", warm_up=False, show_progress=False, background_compile=False)
        runner = llm.engine.runner
        for (kind, size, k), expected in zip(job["graphs"], job["paths"]):
            path = runner.package_path(kind, size, k)
            if str(path) != expected:
                print(f"package {path.name} differs from the one the engine expects ({Path(expected).name}): "
                      "the model or configuration changed", flush=True)
                return 3
            if not path.exists():
                llm.engine.compile_graph(kind, size, k)
            print(f"ready: {path.name}", flush=True)
        return 0
    finally:
        if pid_file.exists() and pid_file.read_text() == str(os.getpid()):
            pid_file.unlink()


if __name__ == "__main__":
    sys.exit(main())
