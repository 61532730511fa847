"""`compiled-spec serve`: an OpenAI-compatible HTTP server over one engine (FastAPI + uvicorn)."""

from __future__ import annotations

import contextlib
import signal

from ..api import LLM
from .app import ServerOptions, api_key_problem, create_app

HEADER_TIMEOUT_S = 10.0  # a request's headers must all arrive within this many seconds of its first byte
KEEP_ALIVE_TIMEOUT_S = 5  # an idle keep-alive connection is closed after this many seconds
MAX_HEADER_BYTES = 16 * 1024  # h11's limit on a request's headers (past it: 400)
MIN_CONNECTIONS = 256  # the connection cap: the larger of this and max_queue + max_batch_size + 64 (past it: 503)


def header_timeout_protocol(header_timeout_s: float):
    """uvicorn's h11 protocol, closing a connection whose request headers do not all arrive within
    header_timeout_s of its first byte (or of the connection's opening). uvicorn itself only times out idle
    keep-alive connections: a client that sends a header byte now and then would hold its connection forever."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutH11Protocol(H11Protocol):
        header_timer = None

        def _arm_header_timer(self) -> None:
            self._cancel_header_timer()
            self.header_timer = self.loop.call_later(header_timeout_s, self._header_timeout)

        def _cancel_header_timer(self) -> None:
            if self.header_timer is not None:
                self.header_timer.cancel()
                self.header_timer = None

        def _header_timeout(self) -> None:
            self.header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.logger.info("closing a connection whose request headers did not arrive within %g s",
                                 header_timeout_s)
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_header_timer()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._cancel_header_timer()  # the headers are in
            elif self.header_timer is None:
                self._arm_header_timer()  # the first bytes of the next request on a kept-alive connection

        def on_response_complete(self) -> None:
            self._cancel_header_timer()  # the keep-alive timeout covers the idle time before the next request
            super().on_response_complete()

        def connection_lost(self, exc) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

    return HeaderTimeoutH11Protocol


def serve(llm: LLM, options: ServerOptions, host: str = "127.0.0.1", port: int = 8000,
          shutdown_timeout_s: float = 30.0, log_level: str = "info", header_timeout_s: float = HEADER_TIMEOUT_S,
          keep_alive_timeout_s: int = KEEP_ALIVE_TIMEOUT_S, max_connections: int | None = None) -> None:
    """Serves until SIGINT or SIGTERM: then it stops admitting, lets running responses finish for up to
    shutdown_timeout_s, aborts what is left, and returns. max_connections defaults to the larger of
    MIN_CONNECTIONS and max_queue + max_batch_size + 64."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn re-raises the signal once it has shut down, so the process would die of SIGTERM after a
            # clean shutdown; here a clean shutdown exits 0.
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    if max_connections is None:
        max_connections = max(MIN_CONNECTIONS, options.max_queue + llm.config.max_batch_size + 64)
    config = uvicorn.Config(create_app(llm, options), host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=shutdown_timeout_s, access_log=False,
                            http=header_timeout_protocol(header_timeout_s), timeout_keep_alive=keep_alive_timeout_s,
                            h11_max_incomplete_event_size=MAX_HEADER_BYTES, limit_concurrency=max_connections)
    Server(config).run()


__all__ = ["ServerOptions", "api_key_problem", "create_app", "serve"]
