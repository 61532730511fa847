"""A server started in a subprocess on 127.0.0.1 and stopped with SIGTERM: for the serve tests and
`python -m compiled_spec.benchmarks.serve` (compiled-spec serve, or llama.cpp's OpenAI-compatible server beside it)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    def __init__(self, process: subprocess.Popen, port: int, api_key: str | None, log: Path):
        self.process, self.port, self.api_key, self.log = process, port, api_key, log
        self.base_url = f"http://127.0.0.1:{port}"

    def client(self, api_key: str | None = None):
        from openai import OpenAI

        return OpenAI(base_url=self.base_url + "/v1", api_key=api_key or self.api_key or "none", max_retries=0,
                      timeout=120)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics: 'name{labels}' -> value."""
        text = httpx.get(self.base_url + "/metrics", timeout=30).text
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                samples[name] = float(value)
        return samples

    def wait_idle(self, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            samples = self.metrics()
            if sum(v for k, v in samples.items() if "num_requests_running" in k or "num_requests_waiting" in k) == 0:
                return
            time.sleep(0.05)
        raise AssertionError("the server did not become idle")


@contextmanager
def running_server(command: list[str], log: Path, api_key: str | None = None, health: str = "/health",
                   startup_timeout_s: float = 180, env: dict[str, str] | None = None):
    """Runs `command` with {port} in it replaced by a free port; yields a Server once `health` answers 200."""
    port = free_port()
    command = [part.replace("{port}", str(port)) for part in command]
    env = {k: v for k, v in {**os.environ, **(env or {})}.items() if k != "COMPILED_SPEC_API_KEY"}
    if api_key:
        env["COMPILED_SPEC_API_KEY"] = api_key
    with open(log, "w") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                   stdin=subprocess.DEVNULL, cwd=Path(__file__).resolve().parents[2])
    server = Server(process, port, api_key, log)
    try:
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if process.poll() is not None:
                raise AssertionError(f"the server exited with {process.returncode}:\n{log.read_text()}")
            try:
                if httpx.get(server.base_url + health, timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"the server did not answer {health} in {startup_timeout_s} s:\n{log.read_text()}")
            time.sleep(0.2)
        yield server
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
