"""A live `compiled-spec serve` in a subprocess on 127.0.0.1, for the serve tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
from openai import OpenAI

from compiled_spec.training.train_tokenizer import train_byte_level_bpe
from tiny_checkpoints import write_checkpoint

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TEXT = (
    "ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is the sun.\n"
    "JULIET: O Romeo, Romeo, wherefore art thou Romeo? Deny thy father and refuse thy name.\n"
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
)


def write_chat_model(path: Path) -> Path:
    """A tiny Llama whose MTP modules mimic it (drafts are often accepted), with a BPE tokenizer and a chat template."""
    tokenizer = train_byte_level_bpe([TEXT * 20], 320)
    tokenizer.chat_template = CHAT_TEMPLATE
    write_checkpoint(path, num_hidden_layers=1, mtp_noise=0.1, vocab_size=len(tokenizer), max_position_embeddings=1024,
                     eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id)
    tokenizer.save_pretrained(str(path))
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    def __init__(self, process: subprocess.Popen, port: int, api_key: str | None, log: Path):
        self.process, self.port, self.api_key, self.log = process, port, api_key, log
        self.base_url = f"http://127.0.0.1:{port}"

    def client(self, api_key: str | None = None) -> OpenAI:
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
def running_server(model: Path, log: Path, *args: str, api_key: str | None = None, startup_timeout_s: float = 180):
    port = free_port()
    command = [sys.executable, "-m", "cli", "serve", "--model", str(model), "--port", str(port), *args]
    env = {**os.environ, "COMPILED_SPEC_API_KEY": api_key} if api_key else {
        k: v for k, v in os.environ.items() if k != "COMPILED_SPEC_API_KEY"}
    with open(log, "w") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                   stdin=subprocess.DEVNULL, cwd=Path(__file__).resolve().parents[1])
    server = Server(process, port, api_key, log)
    try:
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if process.poll() is not None:
                raise AssertionError(f"the server exited with {process.returncode}:\n{log.read_text()}")
            try:
                if httpx.get(server.base_url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"the server did not answer /health in {startup_timeout_s} s:\n{log.read_text()}")
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
