"""Where compiled-spec keeps what it downloads or builds once: named models, tokenizers built from GGUF files."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$COMPILED_SPEC_CACHE, else $XDG_CACHE_HOME/compiled_spec, else ~/.cache/compiled_spec."""
    if os.environ.get("COMPILED_SPEC_CACHE"):
        return Path(os.environ["COMPILED_SPEC_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "compiled_spec"
