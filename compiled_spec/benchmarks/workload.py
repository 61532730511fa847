"""What every cell of a sweep runs: the same prompts, as the same token ids, for the same number of tokens."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

# Openings in the style of the embedded model's corpus; a bench run uses all of them in every cell.
DEFAULT_TEXT_PROMPTS = (
    "ROMEO:\n",
    "JULIET:\nO Romeo, Romeo,",
    "KING HENRY:\nOnce more unto the breach,",
    "First Citizen:\nBefore we proceed any further,",
    "HAMLET:\nTo be, or not to be,",
    "LADY MACBETH:\nCome, you spirits",
    "PROSPERO:\nOur revels now are ended.",
    "Enter a Messenger.\n\nMessenger:\nMy lord,",
)
NUM_DEFAULT_ID_PROMPTS = 8


def read_prompts(path: str | Path) -> list[str | list[int]]:
    """A .json file holds a list of prompts (strings or lists of token ids); any other file one text prompt
    per line, with \\n and \\t standing for newline and tab."""
    path = Path(path)
    text = path.read_text()
    if path.suffix == ".json":
        prompts = json.loads(text)
        if not isinstance(prompts, list) or not all(isinstance(p, (str, list)) and p for p in prompts):
            raise ValueError(f"{path}: expected a JSON list of non-empty prompts (strings or lists of token ids)")
    else:
        prompts = [line.replace("\\n", "\n").replace("\\t", "\t") for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def default_id_prompts(vocab_size: int) -> list[list[int]]:
    """Deterministic token-id prompts of 4..11 tokens, for checkpoints without a tokenizer."""
    return [[(7 * index + 13 * position + 3) % vocab_size for position in range(4 + index)]
            for index in range(NUM_DEFAULT_ID_PROMPTS)]


def prompt_token_ids(model_path: Path, prompts: list[str | list[int]] | None) -> list[list[int]]:
    """The token ids every cell feeds, encoded as LLM.encode does (no special tokens added)."""
    from compiled_spec.loading.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_path)
    if prompts is None:
        if tokenizer is None:
            vocab_size = json.loads((model_path / "config.json").read_text())["vocab_size"]
            return default_id_prompts(vocab_size)
        prompts = list(DEFAULT_TEXT_PROMPTS)
    ids = []
    for prompt in prompts:
        if isinstance(prompt, str):
            if tokenizer is None:
                raise ValueError(f"{model_path} has no tokenizer; give prompts as token ids (a .json prompts file)")
            prompt = tokenizer.encode(prompt, add_special_tokens=False)
        ids.append([int(token) for token in prompt])
    return ids


def auto_max_seq_len(prompt_ids: list[list[int]], max_tokens: int, max_speculative_tokens: int = 8) -> int:
    """Room for the longest prompt, max_tokens and one step's overshoot, rounded up to 16; the same for every k."""
    need = max(len(ids) for ids in prompt_ids) + max_tokens + max_speculative_tokens + 1
    return -(-need // 16) * 16


def digest(token_ids: list[int]) -> str:
    """A short fingerprint of one output, to compare outputs across cells without storing them."""
    return hashlib.sha1(",".join(map(str, token_ids)).encode()).hexdigest()[:12]
