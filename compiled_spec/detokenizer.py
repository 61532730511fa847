"""Text of a request as its tokens arrive, decoded a few tokens at a time.

Decoding the whole output after every token costs time quadratic in its length. IncrementalDetokenizer keeps
vLLM's two offsets instead: `text` is the decoded text of token_ids[:read_offset], and a new token is decoded
in the window token_ids[prefix_offset:], so a token that continues a word or a multi-byte character decodes
with its context. Text is committed only once the window does not end in U+FFFD (an unfinished character).
"""

from __future__ import annotations

from transformers.convert_slow_tokenizer import bytes_to_unicode

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """The decoded text of token_ids, and the first stop string in it, one token at a time."""

    def __init__(self, tokenizer, stops: list[str] | None = None):
        self.tokenizer = tokenizer
        self.stops = list(stops or [])
        self.token_ids: list[int] = []
        self.text = ""  # decoded token_ids[:read_offset]: never changes once written
        self.pending = ""  # what token_ids[read_offset:] decodes to so far (may end in U+FFFD)
        self.prefix_offset = 0
        self.read_offset = 0
        self.stop_at: int | None = None  # where the first stop string begins in text + pending

    @property
    def full_text(self) -> str:
        """The text tokenizer.decode(token_ids, skip_special_tokens=True) gives."""
        return self.text + self.pending

    def add(self, token_id: int) -> bool:
        """Appends one token; True once a stop string appears in the text (stop_at says where)."""
        searched_up_to = len(self.text)
        self.token_ids.append(token_id)
        window_start = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        window = self._decode(self.token_ids[self.prefix_offset:])
        new_text = window[len(window_start):]
        if len(window) > len(window_start) and not window.endswith(REPLACEMENT):
            self.text += new_text
            self.pending = ""
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        else:
            self.pending = new_text
        if self.stops and self.stop_at is None:
            self.stop_at = self._find_stop(searched_up_to)
        return self.stop_at is not None

    def _find_stop(self, searched_up_to: int) -> int | None:
        """The first stop string in full_text. Text before searched_up_to was searched by earlier calls, so only a
        stop that ends after it can be new: the search starts a stop's length before it (linear overall)."""
        text = self.full_text
        start = max(0, searched_up_to - max(map(len, self.stops)) + 1)
        found = [index for stop in self.stops if (index := text.find(stop, start)) >= 0]
        return min(found) if found else None

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True) if token_ids else ""


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
    """Turns accepted tokens into new text, once per call, for streaming.

    Text that could still turn out to be part of a stop string (which is never shown) or an unfinished
    multi-byte character is held back until later tokens decide it; finish() releases the rest of the
    request's final text.
    """

    def __init__(self, tokenizer, stops: list[str] | None):
        self.detokenizer = IncrementalDetokenizer(tokenizer, stops)
        self.stops = self.detokenizer.stops
        self.shown = 0

    def add(self, new_token_ids: list[int]) -> str:
        detokenizer = self.detokenizer
        for token_id in new_token_ids:
            if detokenizer.stop_at is not None:
                break
            detokenizer.add(token_id)
        text = detokenizer.full_text
        safe = len(text.rstrip(REPLACEMENT))
        if detokenizer.stop_at is not None:
            safe = min(safe, detokenizer.stop_at)
        else:
            safe = min(safe, len(text) - held_back(text, self.stops))
        return self._release(text, safe)

    def finish(self, final_text: str) -> str:
        return self._release(final_text, len(final_text))

    def _release(self, text: str, end: int) -> str:
        if end <= self.shown:
            return ""
        new, self.shown = text[self.shown:end], end
        return new


class TokenPieces:
    """Each token's own text and bytes, as logprobs show them. A byte-level BPE token (GPT-2's, SmolLM2's) may hold
    part of a character: its text then decodes to U+FFFD, while its bytes are the token's own, so the bytes of a
    response's tokens join to its text. Other tokenizers' bytes are the UTF-8 of the token's text."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        byte_level = type(getattr(backend, "decoder", None)).__name__ == "ByteLevel"
        self.byte_of = {char: byte for byte, char in bytes_to_unicode().items()} if byte_level else None

    def text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id) if self.byte_of is not None else None
        if piece is None or token_id in self.tokenizer.all_special_ids or any(c not in self.byte_of for c in piece):
            return self.text(token_id).encode()
        return bytes(self.byte_of[char] for char in piece)
