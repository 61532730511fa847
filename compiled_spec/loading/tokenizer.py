"""The model's tokenizer, as transformers.AutoTokenizer makes it: the directory's when it ships one, or built from a
GGUF file's metadata (slow: docs/models.md) and kept in a cache folder after the first time."""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

from .cache import cache_root
from .gguf_checkpoint import is_gguf


# The class AutoTokenizer makes for a tokenizer.json whose config names no model-specific class. Made directly, it
# skips AutoTokenizer's import of every model's tokenizer mapping (about a second of a first generate's start).
GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def folder_tokenizer(folder: Path):
    """AutoTokenizer.from_pretrained(folder), without AutoTokenizer where the folder's class is the generic one."""
    config = folder / "tokenizer_config.json"
    if (folder / "tokenizer.json").is_file() and config.is_file():
        if json.loads(config.read_text()).get("tokenizer_class") in GENERIC_TOKENIZER_CLASSES:
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(str(folder))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def gguf_tokenizer(path: Path):
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:24]
    cached = cache_root() / "tokenizers" / key
    if (cached / "tokenizer_config.json").is_file():
        return folder_tokenizer(cached)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    cached.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=cached.parent))
    tokenizer.save_pretrained(str(staging))
    try:
        staging.rename(cached)  # atomic: a concurrent process either finds the whole folder or none
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    return tokenizer


def load_tokenizer(path: Path):
    if is_gguf(path):
        return gguf_tokenizer(path)
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        return None
    return folder_tokenizer(path)


def eos_token_ids(path: Path, config_eos: tuple[int, ...], tokenizer) -> tuple[int, ...]:
    ids = set(config_eos)
    generation_config = path / "generation_config.json"
    if generation_config.is_file():
        eos = json.loads(generation_config.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))
