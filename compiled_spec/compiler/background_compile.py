"""Full packages compiled by child processes: in the background for a tiered start (the engine decodes in eager
meanwhile), or waited for by a full warm-up that has several graphs to make.

The child is a module its caller names (engine/compile_worker.py), run with the job pickled on its stdin; it compiles
the missing packages into the shared package folder (compiler/aot_packages.py), and the engine loads them once every
one exists (a tiered start switches to them between two steps). The child runs in a session of its own and writes
only files, so it finishes even when the process that started it exits first: a later process loads the packages, or
follows the compile while it still runs.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from torch._inductor.runtime.cache_dir_utils import cache_dir

from ..errors import CompiledSpecError
from ..speculative.step import Drafts

Graph = tuple[str, int, Drafts]  # (kind, size, drafts) as GraphStartup.warm_up_graphs lists them


WORKERS_VARIABLE = "COMPILED_SPEC_COMPILE_WORKERS"


def compile_worker_count(requested: int | None, graphs: int) -> int:
    """Processes that compile `graphs` missing packages: `requested`, else $COMPILED_SPEC_COMPILE_WORKERS, else one
    per CPU core; never more than the graphs."""
    if requested is None:
        value = os.environ.get(WORKERS_VARIABLE, "")
        try:
            requested = int(value) if value else len(os.sched_getaffinity(0))
        except ValueError:
            raise CompiledSpecError(f"{WORKERS_VARIABLE}={value!r} is not a whole number of processes; choose 1 or "
                                    "more", param=WORKERS_VARIABLE) from None
    if requested < 1:
        raise CompiledSpecError(f"compile_workers={requested} is not allowed; choose 1 or more processes",
                                param="compile_workers")
    return max(1, min(requested, graphs))


class BackgroundCompile:
    """Compiles `graphs` (whose packages are `paths`; the child skips those that exist) in a child process, `python
    -m worker`, with `workers` worker processes, or follows the child another process started for the same packages.
    job: what the worker needs besides (its engine's EngineSpec). niceness: how much lower the compile's priority is
    (a tiered start decodes meanwhile)."""

    def __init__(self, worker: str, job: dict, graphs: list[Graph], paths: list[Path], show_progress: bool,
                 workers: int = 1, niceness: int = 10,
                 description: str = "compiling full graphs in the background (decoding in eager meanwhile)",
                 beside_text: bool = False):
        """beside_text: text streams on stdout meanwhile; where stdout and stderr are one file (a terminal, `2>&1`),
        progress is then one line, not a bar redrawn inside the text."""
        self.graphs, self.paths = graphs, paths
        self.failed_file = failed_file(paths)
        folder = paths[0].parent
        folder.mkdir(parents=True, exist_ok=True)
        self.pid_file, self.log = self.failed_file.with_suffix(".pid"), self.failed_file.with_suffix(".log")
        self.started = time.perf_counter()
        self.process: subprocess.Popen | None = None
        self.pid = running_compile(self.pid_file, worker)
        if self.pid is None:
            job = dict(job, graphs=graphs, paths=[str(path) for path in paths], workers=workers,
                       niceness=niceness, threads=torch.get_num_threads(), pid_file=str(self.pid_file))
            with open(self.log, "wb") as log:
                self.process = subprocess.Popen(
                    [sys.executable, "-m", worker], stdin=subprocess.PIPE,
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                    env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir()},
                )
            self.pid = self.process.pid
            self.pid_file.write_text(str(self.pid))  # now, not once the child has imported torch: a process
            self.process.stdin.write(pickle.dumps(job))  # starting meanwhile follows this child
            self.process.stdin.close()
        self.live_bar = show_progress and not (beside_text and stdout_is_stderr())
        if show_progress and not self.live_bar:
            print(f"compiled-spec: {description}; log {self.log}", file=sys.stderr, flush=True)
        self.bar = tqdm(total=len(paths), initial=self.ready_count(), unit="graph", disable=not self.live_bar,
                        desc=description)
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
        if ended and self.ready_count() < len(self.paths):
            self.failed_file.write_text(self.failure() + "\n")  # later starts with the same packages do not retry
            return "failed"
        return "running"

    def wait(self, timeout: float | None = None, interval: float = 0.5) -> str:
        """Polls until the compile is ready or failed (or `timeout` seconds pass); returns poll()'s answer."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (status := self.poll()) == "running" and (deadline is None or time.monotonic() < deadline):
            time.sleep(interval)
        return status

    def join(self, timeout: float = 120) -> None:
        """Waits (at most `timeout` seconds) until the child this object started has exited, workers included."""
        if self.process is not None:
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                pass

    def failure(self) -> str:
        """The last line the compiling process logged."""
        try:
            lines = [line for line in self.log.read_text(errors="replace").splitlines() if line.strip()]
        except OSError:
            return "no log"
        return lines[-1] if lines else "no output"

    def stop(self) -> None:
        """Ends the child this object started and its workers (the packages they finished stay)."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)  # the child leads its own session: its workers are in it
            self.process.wait()
        self.bar.close()
        atexit.unregister(self._say_still_running)


def stdout_is_stderr() -> bool:
    """Whether stdout and stderr are one file (a terminal, or a redirect such as `2>&1`)."""
    try:
        out, err = os.fstat(sys.stdout.fileno()), os.fstat(sys.stderr.fileno())
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError and a ValueError
        return False
    return (out.st_dev, out.st_ino) == (err.st_dev, err.st_ino)


def failed_file(paths: list[Path]) -> Path:
    """Where a failed compile of these packages is remembered. Their names hold the package key (code, torch,
    options, whether the CPU kernels built), so a change to any of those is a new name and a new try."""
    name = hashlib.sha256("\0".join(sorted(path.name for path in paths)).encode()).hexdigest()[:16]
    return paths[0].parent / f"compile-{name}.failed"


def earlier_failure(paths: list[Path]) -> str | None:
    """Why an earlier compile of these packages failed, if one did."""
    try:
        return failed_file(paths).read_text().strip() or "no output"
    except OSError:
        return None


def running_compile(pid_file: Path, worker: str) -> int | None:
    """The pid of a live process compiling these packages, if one is. A pid file left by a process that died names
    a pid the system may have given to another process since (this one, even): that one is not followed."""
    try:
        pid = int(pid_file.read_text())
    except (OSError, ValueError):
        return None
    return pid if pid != os.getpid() and process_alive(pid) and runs_module(pid, worker) else None


def runs_module(pid: int, module: str) -> bool:
    """Whether process `pid` runs `python -m module` (where /proc cannot say, it is taken to)."""
    try:
        command_line = Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return not Path("/proc/self").exists()
    except OSError:
        return True
    return module.encode() in command_line


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
