"""The serve tests' model, and `compiled-spec serve` started on it in a subprocess on 127.0.0.1."""

from __future__ import annotations

import sys
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


def serve_command(model: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "compiled_spec.cli", "serve", "--model", str(model), "--port", "{port}", *args]
