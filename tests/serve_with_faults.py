"""`compiled-spec serve` with faults a test can inject into the engine thread while the server runs.

    python tests/serve_with_faults.py FAULT_DIR serve --model ...

A file FAULT_DIR/step or FAULT_DIR/poll makes the next decode step or background-compile poll raise once (the file
is removed when it fires); FAULT_DIR/die makes the next step raise SystemExit, which ends the engine thread (nothing
catches it); FAULT_DIR/slow holds seconds each decode step sleeps first (so a test can act while a
request is mid-generation). FAULT_DIR/zero_drafts, present at the start, gives the engine a step graph compiled in its
graph mode with a pass that zeroes the drafts it writes (faults.ScaledStateWrite("draft_tokens", 0)): what the graph canary must catch.

Events, so that tests wait on what the server did rather than on the clock:
- FAULT_DIR/hold: while it exists, each decode step waits before it runs, with FAULT_DIR/held written (removed when
  the step goes on). A test holds a request mid-generation, or lets requests queue up, and then removes it.
- FAULT_DIR/hold_switch: while it exists, the engine does not switch to graphs compiled in the background (the
  compile itself goes on); a test sees the eager part of a tiered start for as long as it needs.
- FAULT_DIR/inbox: one line per message the HTTP side hands the engine thread: "add INDEX" (a request), "abort
  INDEX" (its client went away).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from compiled_spec.engine.engine import Engine  # noqa: E402
from compiled_spec.engine.startup import GraphStartup  # noqa: E402
from compiled_spec.server.engine_loop import EngineLoop  # noqa: E402

SECRET = "injected fault 7f3a: secret engine detail"


def fires(fault_dir: Path, name: str) -> bool:
    trigger = fault_dir / name
    try:
        trigger.unlink()
    except FileNotFoundError:
        return False
    return True


def wait_while(trigger: Path, held: Path) -> None:
    """Waits while `trigger` exists, with `held` written meanwhile."""
    if not trigger.exists():
        return
    held.touch()
    while trigger.exists():
        time.sleep(0.01)
    held.unlink()


def install(fault_dir: Path) -> None:
    step, poll_background, warm_up = Engine.step, GraphStartup.poll_background, GraphStartup.warm_up
    submit, abort = EngineLoop.submit, EngineLoop.abort

    def faulty_step(self, *args, **kwargs):
        wait_while(fault_dir / "hold", fault_dir / "held")
        slow = fault_dir / "slow"
        if slow.exists():
            time.sleep(float(slow.read_text() or 0))
        if fires(fault_dir, "die"):
            raise SystemExit(f"{SECRET} (die)")
        if fires(fault_dir, "step"):
            raise RuntimeError(f"{SECRET} (step)")
        return step(self, *args, **kwargs)

    def faulty_poll(self, *args, **kwargs):
        if fires(fault_dir, "poll"):
            raise RuntimeError(f"{SECRET} (poll)")
        if self.background is not None and (fault_dir / "hold_switch").exists():
            return "running"
        return poll_background(self, *args, **kwargs)

    def recorded_submit(self, pending) -> None:
        submit(self, pending)
        with open(fault_dir / "inbox", "a") as inbox:
            inbox.write(f"add {pending.index}\n")

    def recorded_abort(self, index: int) -> None:
        abort(self, index)
        with open(fault_dir / "inbox", "a") as inbox:
            inbox.write(f"abort {index}\n")

    def faulty_graph_after_warm_up(self, *args, **kwargs):
        warm_up(self, *args, **kwargs)
        if (fault_dir / "zero_drafts").exists():
            from compiled_spec.compiler.step_runner import StepRunner
            from faults import ScaledStateWrite

            engine = self.engine
            engine.use_runner(StepRunner(engine.model, engine.state, engine.constants, engine.runner.mode,
                                         engine.runner.step_drafts, passes=[ScaledStateWrite("draft_tokens", 0)]), initial=True)

    Engine.step, GraphStartup.poll_background = faulty_step, faulty_poll
    EngineLoop.submit, EngineLoop.abort = recorded_submit, recorded_abort
    GraphStartup.warm_up = faulty_graph_after_warm_up


if __name__ == "__main__":
    install(Path(sys.argv[1]))
    from compiled_spec.cli import main

    sys.argv = ["compiled-spec", *sys.argv[2:]]
    main()
