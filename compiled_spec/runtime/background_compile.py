"""Tiered start: the full graphs compile in a child process while the engine decodes in eager.

The child builds the same engine from the same LLM arguments and compiles the missing packages into the shared
package folder (runtime/packaged.py); the engine switches to them between two steps once every one exists. The
child runs in a session of its own, at a lower priority, and writes only files, so it finishes even when the process
that started it exits first: a later process loads the packages, or follows the compile while it still runs.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from torch._inductor.runtime.cache_dir_utils import cache_dir

Graph = tuple[str, int, "int | None"]  # (kind, size, k) as Engine.warm_up_graphs lists them


class BackgroundCompile:
    """Compiles `graphs` (whose packages are `paths`; the child skips those that exist) in a child process, or
    follows the child another process started for the same packages."""

    def __init__(self, llm_arguments: dict, graphs: list[Graph], paths: list[Path], show_progress: bool):
        self.graphs, self.paths = graphs, paths
        name = hashlib.sha256("\0".join(sorted(path.name for path in paths)).encode()).hexdigest()[:16]
        folder = paths[0].parent
        folder.mkdir(parents=True, exist_ok=True)
        self.pid_file, self.log = folder / f"compile-{name}.pid", folder / f"compile-{name}.log"
        self.started = time.perf_counter()
        self.process: subprocess.Popen | None = None
        self.pid = running_compile(self.pid_file)
        if self.pid is None:
            job = dict(llm=llm_arguments, graphs=graphs, paths=[str(path) for path in paths],
                       threads=torch.get_num_threads(), pid_file=str(self.pid_file))
            with open(self.log, "wb") as log:
                self.process = subprocess.Popen(
                    [sys.executable, "-m", "compiled_spec.runtime.compile_worker"], stdin=subprocess.PIPE,
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                    env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir()},
                )
            self.pid = self.process.pid
            self.pid_file.write_text(str(self.pid))  # now, not once the child has imported torch: a process
            self.process.stdin.write(pickle.dumps(job))  # starting meanwhile follows this child
            self.process.stdin.close()
        self.bar = tqdm(total=len(paths), initial=self.ready_count(), unit="graph", disable=not show_progress,
                        desc="compiling full graphs in the background (decoding in eager meanwhile)")
        if show_progress:
            atexit.register(self._say_still_running)

    def _say_still_running(self) -> None:
        if self.ready_count() < len(self.paths) and process_alive(self.pid):
            print(f"compiled-spec: the full graphs are still compiling in the background (pid {self.pid}, log "
                  f"{self.log}); a later run loads them when they are ready", file=sys.stderr)

    def ready_count(self) -> int:
        return sum(path.exists() for path in self.paths)

    def poll(self) -> str:
        """"ready" (every package exists), "running", or "failed" (the compiling process ended without them)."""
        ready = self.ready_count()
        self.bar.update(ready - self.bar.n)
        if ready == len(self.paths):
            self.bar.close()
            atexit.unregister(self._say_still_running)
            return "ready"
        if self.process is not None:
            ended = self.process.poll() is not None
        else:
            ended = not process_alive(self.pid)
        return "failed" if ended and self.ready_count() < len(self.paths) else "running"

    def wait(self, timeout: float | None = None, interval: float = 0.5) -> str:
        """Polls until the compile is ready or failed (or `timeout` seconds pass); returns poll()'s answer."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (status := self.poll()) == "running" and (deadline is None or time.monotonic() < deadline):
            time.sleep(interval)
        return status

    def failure(self) -> str:
        """The last line the compiling process logged."""
        try:
            lines = [line for line in self.log.read_text(errors="replace").splitlines() if line.strip()]
        except OSError:
            return "no log"
        return lines[-1] if lines else "no output"

    def stop(self) -> None:
        """Ends the child this object started (the packages it finished stay)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.bar.close()
        atexit.unregister(self._say_still_running)


def running_compile(pid_file: Path) -> int | None:
    """The pid of a live process compiling these packages, if one is."""
    try:
        pid = int(pid_file.read_text())
    except (OSError, ValueError):
        return None
    return pid if process_alive(pid) else None


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a child of this process that has exited but was not yet reaped is a zombie, not alive
        return os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:
        return True
