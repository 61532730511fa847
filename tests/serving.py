"""The serve tests' model, and `compiled-spec serve` started on it in a subprocess on 127.0.0.1."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from compiled_spec.training.train_tokenizer import train_byte_level_bpe
from tiny_checkpoints import write_checkpoint

CHAT_TEMPLATE = (  # raises, as many real templates do, on a conversation that opens with the assistant
    "{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('Conversations must not open with the "
    "assistant') }}{% endif %}"
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
    write_checkpoint(path, num_hidden_layers=1, mtp_noise=0.1, vocab_size=len(tokenizer),
                     max_position_embeddings=1024, eos_token_id=tokenizer.eos_token_id,
                     bos_token_id=tokenizer.eos_token_id)
    tokenizer.save_pretrained(str(path))
    return path


def serve_command(model: Path, *args: str, faults: Path | None = None) -> list[str]:
    """`compiled-spec serve`; with `faults`, through tests/serve_with_faults.py, whose hooks (holds, faults, the
    inbox record) that folder's files drive."""
    program = [str(Path(__file__).with_name("serve_with_faults.py")), str(faults)] if faults else ["-m", "compiled_spec.cli"]
    return [sys.executable, *program, "serve", "--model", str(model), "--port", "{port}", *args]


def wait_for(condition, what: str, timeout_s: float = 300) -> None:
    """Waits for something the server does (a file its test hooks write, a count in /metrics). The timeout only ends
    a test whose event never comes; no assertion depends on how soon it comes."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(0.02)


def inbox(faults: Path, kind: str) -> list[int]:
    """The request indices of every "add" or "abort" the HTTP side has handed the engine thread so far."""
    path = faults / "inbox"
    lines = path.read_text().splitlines() if path.exists() else []
    return [int(line.split()[1]) for line in lines if line.split()[0] == kind]
