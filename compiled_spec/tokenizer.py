"""The model directory's tokenizer, through transformers.AutoTokenizer, when it ships one."""

from __future__ import annotations

import json
from pathlib import Path


def load_tokenizer(path: Path):
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def eos_token_ids(path: Path, config_eos: tuple[int, ...], tokenizer) -> tuple[int, ...]:
    ids = set(config_eos)
    generation_config = path / "generation_config.json"
    if generation_config.is_file():
        eos = json.loads(generation_config.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))
