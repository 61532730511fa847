"""The child that compiles full packages (compiler/background_compile.py starts it): reads its job (pickled) from stdin
and compiles each missing graph's package into the shared folder, in `workers` processes at once. Every worker builds
the engine the job's EngineSpec describes, in full, and takes the next graph when it is done.

Each graph's compile is single-threaded Python and one g++ run, so N graphs on N cores take about as long as one."""

from __future__ import annotations

import os
import pickle
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path

_engine = None  # this worker's engine, built once
_build_error: Exception | None = None  # raised by every compile_one: a failed pool initializer says only "broken"


class PackageMismatch(Exception):
    """The engine built here names another package than the one the parent expects."""


def build(job: dict) -> None:
    global _engine, _build_error
    os.nice(job["niceness"])
    try:
        import torch

        torch.set_num_threads(job["threads"])  # the thread count is part of every package's key
        from compiled_spec.config import GraphMode
        from compiled_spec.engine.engine import Engine

        spec = job["spec"].with_config(graph_mode=GraphMode.FULL)
        model = spec.load_model()
        tokenizer, eos_ids = spec.load_tokenizer(model)
        _engine = Engine(model, spec.config, eos_ids, tokenizer)
    except Exception as error:
        _build_error = error


def build_in_pool(job: dict) -> None:
    """A pool worker's build; the worker ends once the child that started it is gone (killed, say), where it
    would otherwise go on compiling, holding hundreds of MB, for nobody."""
    threading.Thread(target=exit_with_parent, args=(os.getppid(),), daemon=True).start()
    build(job)


def exit_with_parent(parent: int, interval: float = 0.5) -> None:
    while os.getppid() == parent:
        time.sleep(interval)
    os._exit(1)


def compile_one(graph: tuple, expected: str) -> str:
    """Compiles one graph unless its package exists; returns what the log says of it."""
    if _build_error is not None:
        raise _build_error
    path = _engine.runner.package_path(*graph)
    if str(path) != expected:
        raise PackageMismatch(f"package {path.name} differs from the one the engine expects ({Path(expected).name}): "
                              "the model or configuration changed")
    start = time.perf_counter()
    if not path.exists():
        _engine.startup.compile_graph(*graph)
    return f"ready: {path.name} (pid {os.getpid()}, {time.perf_counter() - start:.1f} s)"


def main() -> int:
    job = pickle.load(sys.stdin.buffer)
    pid_file = Path(job["pid_file"])  # the parent wrote this process's pid into it
    try:
        missing = [(tuple(graph), path) for graph, path in zip(job["graphs"], job["paths"]) if not Path(path).exists()]
        if not missing:  # another process made them meanwhile
            return 0
        workers = min(job["workers"], len(missing))
        print(f"compiling {len(missing)} graphs in {workers} processes", flush=True)
        if workers == 1:
            build(job)
            for graph, path in missing:
                print(compile_one(graph, path), flush=True)
            return 0
        with ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=build_in_pool,
                                 initargs=(job,)) as pool:
            futures = [pool.submit(compile_one, graph, path) for graph, path in missing]
            for future in as_completed(futures):
                print(future.result(), flush=True)
        return 0
    except PackageMismatch as error:
        print(error, flush=True)
        return 3
    finally:
        if pid_file.exists() and pid_file.read_text() == str(os.getpid()):
            pid_file.unlink()


if __name__ == "__main__":
    sys.exit(main())
