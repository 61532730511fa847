"""Text of a request as its tokens arrive: what is safe to show so far, for streaming."""

from __future__ import annotations


def held_back(text: str, stops: list[str]) -> int:
    """Characters at the end of `text` that may be the start of a stop string."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


class TextStream:
    """Turns accepted tokens into new text, once per call.

    Text that could still turn out to be part of a stop string (which is never shown) or an
    unfinished multi-byte character is held back until later tokens decide it; finish() releases
    the rest of the request's final text.
    """

    def __init__(self, tokenizer, stops: list[str] | None):
        self.tokenizer = tokenizer
        self.stops = stops or []
        self.token_ids: list[int] = []
        self.shown = 0

    def add(self, new_token_ids: list[int]) -> str:
        self.token_ids.extend(new_token_ids)
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        safe = len(text.rstrip("\ufffd"))
        cuts = [text.find(stop) for stop in self.stops if stop in text]
        if cuts:
            safe = min(safe, *cuts)
        else:
            safe = min(safe, len(text) - held_back(text, self.stops))
        return self._release(text[:safe])

    def finish(self, final_text: str) -> str:
        return self._release(final_text)

    def _release(self, text: str) -> str:
        if len(text) <= self.shown:
            return ""
        new, self.shown = text[self.shown:], len(text)
        return new
