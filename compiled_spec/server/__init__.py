"""`compiled-spec serve`: an OpenAI-compatible HTTP server over one engine (FastAPI + uvicorn)."""

from __future__ import annotations

import contextlib
import signal

from ..api import LLM
from .app import ServerOptions, create_app


def serve(llm: LLM, options: ServerOptions, host: str = "127.0.0.1", port: int = 8000,
          shutdown_timeout_s: float = 30.0, log_level: str = "info") -> None:
    """Serves until SIGINT or SIGTERM: then it stops admitting, lets running responses finish for up to
    shutdown_timeout_s, aborts what is left, and returns."""
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

    config = uvicorn.Config(create_app(llm, options), host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=shutdown_timeout_s, access_log=False)
    Server(config).run()


__all__ = ["ServerOptions", "create_app", "serve"]
