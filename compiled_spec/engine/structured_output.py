"""Structured output on the host: each request's JSON schema compiled to a grammar (xgrammar), a matcher per choice,
and the token masks the step applies (speculative/token_masks.py).

Before every step the engine walks each constrained lane's matcher through the drafts the step verifies: row j's mask
is what the grammar allows after the lane's tokens and its drafts 0..j-1. Where the grammar forces the next text (an
object's keys, its punctuation), the draft is that text's first token, with a one-hot q; forced tokens also extend the
drafts, so a lane drafts through a schema's fixed parts even without MTP modules. The walk stops at a draft the grammar
refuses (the masked target rejects it, so the rows after it are never reached; they allow everything), and the matcher
rolls back to the committed tokens. After the step the matcher accepts the emitted tokens; once the grammar is complete
the request ends ("stop"). The walk is the host's work per step (docs/structured-output.md gives its measured cost).
"""

from __future__ import annotations

import functools
import json
from typing import Callable

import torch

from ..errors import CompiledSpecError
from ..speculative.token_masks import ALL_TOKENS

# OpenAI's json_object: any JSON object (properties beyond a schema's are allowed only here).
ANY_OBJECT_SCHEMA = {"type": "object"}


class Grammars:
    """An engine's grammar compiler over its tokenizer, made at its first constrained request (about 0.1 s for a 49k
    vocabulary); compiled schemas are cached by their text."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: tuple[int, ...]):
        import xgrammar

        self._xgrammar = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_ids))
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=2)
        self.encode = functools.lru_cache(maxsize=4096)(
            lambda text: tuple(tokenizer.encode(text, add_special_tokens=False)))

    def compile(self, schema: dict | bool):
        """SamplingParams.json_schema (a schema, or True: any JSON object) -> a compiled grammar. JSON is written
        without free whitespace (a small model can otherwise emit it forever); a schema's objects take only the
        properties it names."""
        strict = schema is not True
        text = json.dumps(ANY_OBJECT_SCHEMA if schema is True else schema)
        try:
            return self.compiler.compile_json_schema(text, any_whitespace=False, strict_mode=strict)
        except (RuntimeError, ValueError, TypeError) as error:
            message = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
            raise CompiledSpecError(f"json_schema cannot be compiled to a grammar: {message[:300]}",
                                    param="json_schema") from None

    def matcher(self, grammar) -> "Constraint":
        return Constraint(self._xgrammar.GrammarMatcher(grammar), self.encode)


class Constraint:
    """One choice's position in its grammar."""

    def __init__(self, matcher, encode: Callable[[str], tuple[int, ...]]):
        self.matcher = matcher
        self.encode = encode

    @property
    def complete(self) -> bool:
        return self.matcher.is_terminated()

    def walk(self, masks: torch.Tensor, drafts: list[int], limit: int) -> tuple[list[int], list[int]]:
        """Fills masks [rows, words] (int32, contiguous, on the CPU) for a step verifying `drafts` (at most `limit`):
        row j allows what may follow the drafts before it. Where the grammar forces what comes next, the draft there
        is the forced text's first token instead (a deterministic draft, its q one-hot: lossless, as n-gram drafts
        are), and forced tokens extend the drafts up to limit. Rows past a refused draft allow everything.
        Returns (the drafts the step verifies, the rows that hold a forced token)."""
        matcher, walked, forced, filled = self.matcher, [], [], 0
        for row in range(limit + 1):
            if matcher.is_terminated():
                break
            matcher.fill_next_token_bitmask(masks, row)
            filled = row + 1
            if row == limit:
                break
            token = self._forced_token()
            if token is not None:
                forced.append(row)
            elif row < len(drafts) and matcher.accept_token(drafts[row]):
                token = drafts[row]
            else:
                break
            walked.append(token)
        masks[filled:].fill_(ALL_TOKENS)
        if walked:
            matcher.rollback(len(walked))
        return walked + drafts[len(walked):], forced

    def _forced_token(self) -> int | None:
        """The first token of the text the grammar forces next (accepted), or None where it forces none."""
        text = self.matcher.find_jump_forward_string()
        if not text:
            return None
        tokens = self.encode(text)
        if tokens and self.matcher.accept_token(tokens[0]):
            return tokens[0]
        return None

    def accept(self, tokens: list[int]) -> int:
        """Advances over emitted tokens up to the grammar's end; returns how many it took."""
        for taken, token in enumerate(tokens):
            if self.matcher.is_terminated():
                return taken
            if not self.matcher.accept_token(token):
                raise RuntimeError(f"the step emitted token {token}, which the request's grammar refuses: its mask "
                                   "was not applied")
        return len(tokens)
