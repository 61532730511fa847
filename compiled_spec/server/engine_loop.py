"""The one thread that owns the engine. HTTP handlers hand it requests and aborts through a queue; it queues them
on the engine, whose scheduler admits waiting requests into free slots between steps (so a request that arrives
mid-decode joins the running batch), steps, and sends each request's tokens and its end back to the handler's
event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..engine.engine import Engine, Request
from ..params import RequestOutput, TokenLogprob
from .metrics import ServerMetrics

log = logging.getLogger("compiled_spec.server")


class QueueFull(Exception):
    pass


class ShuttingDown(Exception):
    pass


@dataclass(eq=False)
class Pending:
    """One request on its way through the loop, and the handler's queue of its events: for each of its n choices
    ("tokens", (choice, [ids], [TokenLogprob] or None)) and then ("done", (choice, RequestOutput)); or once
    ("error", message). The message is for the server's log; a client is told only request_id (the id of its
    response), which the log names beside it."""

    request: Request
    events: asyncio.Queue
    event_loop: asyncio.AbstractEventLoop
    request_id: str = ""
    arrived: float = field(default_factory=time.monotonic)
    last_token_at: float | None = None
    ended: bool = False
    running: set[int] = field(default_factory=set)  # the engine indices of its choices that have not ended

    @property
    def index(self) -> int:
        return self.request.index

    @property
    def choices(self) -> list[Request]:
        return self.request.choices

    def send(self, kind: str, value) -> None:
        try:
            self.event_loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the handler's event loop is closed: nobody is listening any more
            pass


class EngineLoop:
    def __init__(self, engine: Engine, metrics: ServerMetrics, max_queue: int, step_log: Path | None = None):
        self.engine = engine
        self.metrics = metrics
        self.max_queue = max_queue
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: dict[int, Pending] = {}  # taken from the inbox, not ended: waiting in the engine or running
        self._lock = threading.Lock()
        self._queued = 0  # submitted and not yet admitted (or dropped)
        self._accepting = True
        self._steps = 0
        self._step_log = open(step_log, "a", buffering=1) if step_log else None
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._ready = threading.Event()
        self._warm_up_error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def wait_ready(self) -> None:
        """Blocks until the engine is warm (every bucket compiled or captured); re-raises a warm-up failure."""
        self._ready.wait()
        if self._warm_up_error is not None:
            raise self._warm_up_error

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, pending: Pending) -> None:
        with self._lock:
            if not self._accepting:
                raise ShuttingDown()
            if self._queued >= self.max_queue:
                raise QueueFull()
            self._queued += 1
        self._inbox.put(("add", pending))

    def abort(self, index: int) -> None:
        """Drops the request at the next step boundary, waiting or running (a client went away)."""
        self._inbox.put(("abort", index))

    def stop(self) -> None:
        """Admits nothing more, aborts what is still waiting or running, and ends the thread."""
        with self._lock:
            self._accepting = False
        self._inbox.put(("stop", None))
        self._thread.join()
        if self._step_log:
            self._step_log.close()

    def _run(self) -> None:
        # Warm up here, not in the thread that built the engine: CUDA graph trees belong to the thread that
        # recorded them, so graphs must be captured where they are replayed.
        try:
            self.engine.startup.warm_up()
        except BaseException as error:
            self._warm_up_error = error
            return
        finally:
            self._ready.set()
        try:
            while self._serve_once():
                pass
            for pending in list(self._pending.values()):
                self._abort(pending)
        except BaseException:
            log.exception("the engine loop stopped")
            raise
        finally:  # whatever ended the loop, nobody is left waiting for an answer that cannot come
            with self._lock:
                self._accepting = False
            left = list(self._pending.values())
            while True:  # requests submitted before the flag was set (the engine is not touched again)
                try:
                    kind, value = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if kind == "add":
                    left.append(value)
            for pending in left:
                if not pending.ended:
                    self._end(pending, pending.request.output, error="the engine loop stopped")
            self.metrics.running.set(0)
            self.metrics.waiting.set(0)

    def _serve_once(self) -> bool:
        """One turn of the loop: messages, admissions, a step (or, idle, a background-compile poll). A fault in any of
        them fails the running requests and the loop goes on; False on stop."""
        try:
            if not self._handle_inbox(block=not self.engine.has_work()):
                return False
            self._ended(self.engine.admit_waiting(self._on_tokens, self._admission_failed, lambda _: self._dequeued()))
            if self.engine.slots:
                self._step()
            else:  # idle: a tiered start still switches once its background compile is done
                self.engine.startup.poll_background()
        except Exception as error:
            self._fail_running("the engine loop failed", error)
        self.metrics.running.set(len(self.engine.slots))
        self.metrics.waiting.set(self._queued)
        return True

    def _handle_inbox(self, block: bool) -> bool:
        """Takes every message waiting (blocking for the first when idle); False on stop."""
        messages = []
        if block:  # while a background compile runs, wake up now and then to switch when it is done
            try:
                messages.append(self._inbox.get(timeout=1.0 if self.engine.startup.background is not None else None))
            except queue.Empty:
                pass
        while True:
            try:
                messages.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        for kind, value in messages:
            if kind == "stop":
                return False
            if kind == "add":
                value.running = {choice.index for choice in value.choices}
                for choice in value.choices:
                    self._pending[choice.index] = value
                self.engine.add(value.request)
            elif kind == "abort":
                pending = self._pending.get(value)
                if pending is not None:
                    self._abort(pending)
        return True

    def _admission_failed(self, request: Request, error: Exception) -> None:
        """A fault of the engine, not of the request: report it, keep serving."""
        pending = self._pending[request.index]
        pending.running.clear()  # none of its choices was admitted
        log.exception("prefill failed for request %s", pending.request_id, exc_info=error)
        self._fail(pending, f"prefill failed: {error}")

    def _step(self) -> None:
        try:
            record = self.engine.step(self._on_tokens)
        except Exception as error:
            self._fail_running("decode step failed", error)
            return
        self._steps += 1
        self.metrics.record_step([accepted for _, accepted in record.lanes], record.verified, record.lane_drafts,
                                 record.tree, record.on_leaf)
        if record.divergence is not None:
            self.metrics.graph_divergence.inc()
        if self._step_log:
            self._step_log.write(json.dumps({
                "step": self._steps, "time": time.time(), "lanes": [index for index, _ in record.lanes],
                "accepted": [accepted for _, accepted in record.lanes], "waiting": self._queued,
                "seconds": record.seconds, "num_drafts": record.num_drafts, "tree": record.tree,
            }) + "\n")
        self._ended(record.finished)

    def _on_tokens(self, index: int, token_ids: list[int]) -> None:
        pending = self._pending[index]
        request = next(choice for choice in pending.choices if choice.index == index)
        now = time.monotonic()
        if pending.last_token_at is None:
            self.metrics.time_to_first_token.observe(now - pending.arrived)
        else:
            self.metrics.inter_token_latency.observe(now - pending.last_token_at)
        pending.last_token_at = now
        logprobs = request.output.logprobs  # the engine appended the tokens' entries before this call
        pending.send("tokens", (request.output.index, token_ids,
                                None if logprobs is None else logprobs[len(logprobs) - len(token_ids):]))

    def _ended(self, requests: list[Request]) -> None:
        for request in requests:
            self._end_choice(self._pending[request.index], request)

    def _end_choice(self, pending: Pending, request: Request) -> None:
        """One choice finished; the response ends with its last (until then every choice's index still finds it: a
        handler aborts by the first one's)."""
        pending.running.discard(request.index)
        if not pending.running:
            for choice in pending.choices:
                self._pending.pop(choice.index, None)
        self.metrics.record_finished(request.output, time.monotonic() - pending.arrived)
        pending.ended = not pending.running
        pending.send("done", (request.output.index, request.output))

    def _abort(self, pending: Pending) -> None:
        if any(request is pending.request for request in self.engine.waiting):
            self._dequeued()
        for choice in pending.choices:
            if choice.index in pending.running:
                self.engine.abort(choice.index)
                choice.output.finish_reason = choice.output.finish_reason or "abort"  # a sibling still waiting
                self._end_choice(pending, choice)

    def _fail_running(self, what: str, error: Exception) -> None:
        running = list(dict.fromkeys(self._pending[request.index] for request in self.engine.slots))
        log.error("%s; failing the %d running requests (%s)", what, len(running),
                  ", ".join(p.request_id for p in running) or "none", exc_info=error)
        for pending in running:
            self._fail(pending, f"{what}: {error}")

    def _fail(self, pending: Pending, message: str) -> None:
        for choice in pending.choices:
            if any(request is choice for request in self.engine.slots):
                try:
                    self.engine.abort(choice.index)
                except Exception:  # the slot stays taken, but the request still gets its answer
                    log.exception("freeing the slot of request %s failed", pending.request_id)
        output = pending.request.output
        output.finish_reason, output.error = "error", message
        self._end(pending, output, error=message)

    def _end(self, pending: Pending, output: RequestOutput, error: str) -> None:
        """The response ends with an error, whatever its choices did."""
        for choice in pending.choices:
            self._pending.pop(choice.index, None)
        pending.running.clear()
        pending.ended = True
        self.metrics.record_finished(output, time.monotonic() - pending.arrived)
        pending.send("error", error)

    def _dequeued(self) -> None:
        with self._lock:
            self._queued -= 1
