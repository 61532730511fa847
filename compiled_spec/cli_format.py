"""What the `compiled-spec` command prints: streamed text, per-request records, the stats line."""

from __future__ import annotations

import json
from typing import Callable

from .model import cpu_kernels
from .params import RequestOutput, SpecStats
from .detokenizer import TextStream

Prompt = str | list[int]


def prompt_text(prompt: Prompt, tokenizer) -> str:
    if isinstance(prompt, str):
        return prompt
    if tokenizer is not None:
        return tokenizer.decode(prompt, skip_special_tokens=True)
    return " ".join(map(str, prompt)) + " ->"


def completion(prompt: Prompt, output: RequestOutput, tokenizer) -> str:
    """The prompt followed by what was generated; token ids when the model has no tokenizer."""
    if tokenizer is None:
        return prompt_text(prompt, None) + "".join(f" {token}" for token in output.token_ids)
    return prompt_text(prompt, tokenizer) + output.text


def request_header(index: int, total: int, output: RequestOutput) -> str:
    if output.finish_reason == "error":
        return f"--- prompt {index + 1} of {total}: error"
    return f"--- prompt {index + 1} of {total}: {len(output.token_ids)} tokens, finish_reason={output.finish_reason}"


class Streamer:
    """Prints one request as tokens are accepted (token ids for a model without a tokenizer)."""

    def __init__(self, prompt: Prompt, tokenizer, stops: list[str] | None, echo: Callable[..., None]):
        self.text = TextStream(tokenizer, stops) if tokenizer is not None else None
        self.echo = echo
        echo(prompt_text(prompt, tokenizer), nl=False)

    def on_tokens(self, request_index: int, new_token_ids: list[int]) -> None:
        if self.text is None:
            self._show("".join(f" {token}" for token in new_token_ids))
        else:
            self._show(self.text.add(new_token_ids))

    def finish(self, output: RequestOutput) -> None:
        if self.text is not None and output.finish_reason != "error":
            self._show(self.text.finish(output.text))
        self.echo("")

    def _show(self, text: str) -> None:
        if text:
            self.echo(text, nl=False)


def stats_record(stats: SpecStats) -> dict:
    return {
        "num_speculative_tokens": stats.num_speculative_tokens,
        "steps": stats.steps,
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "acceptance_rate_per_position": stats.acceptance_rate_per_position,
        "verified_per_position": stats.verified_per_position,
        "mean_accepted_length": stats.mean_accepted_length,
        "steps_per_num_drafts": {str(k): count for k, count in sorted(stats.steps_per_num_drafts.items())},
        "tree_steps": stats.tree_steps,
        "leaf_steps": stats.leaf_steps,
    }


def num_drafts_used(stats: SpecStats) -> str:
    """How often each k was chosen: "k=0 12 steps, k=2 30 steps"."""
    return ", ".join(f"k={k} {count} steps" for k, count in sorted(stats.steps_per_num_drafts.items()))


def request_record(index: int, prompt: Prompt, output: RequestOutput) -> dict:
    return {
        "index": index,
        "prompt": prompt,
        "prompt_token_ids": output.prompt_token_ids,
        "text": output.text,
        "token_ids": output.token_ids,
        "finish_reason": output.finish_reason,
        "error": output.error,
        "stats": stats_record(output.stats),
    }


class Summary:
    """All requests of one command together: tokens/s and the merged speculation statistics."""

    def __init__(self, num_speculative_tokens: int | str, graph_mode: str, outputs: list[RequestOutput],
                 elapsed_s: float, max_drafts: int | None = None, weight_format: str | None = None,
                 draft_tree: tuple[int, ...] | None = None, drafter: str | None = None):
        """num_speculative_tokens: k or "auto"; max_drafts: the most drafts a step verifies (default: k);
        weight_format: how the main model's matrices are held (LLM.weight_format); draft_tree: the engine's token
        tree (widths per depth), if any; drafter: what drafted ("mtp", "ngram")."""
        self.num_speculative_tokens = num_speculative_tokens
        self.drafter = drafter
        self.draft_tree = draft_tree
        self.weight_format = weight_format
        self.graph_mode = graph_mode
        self.elapsed_s = elapsed_s
        self.requests = len(outputs)
        self.errors = sum(output.finish_reason == "error" for output in outputs)
        self.generated_tokens = sum(len(output.token_ids) for output in outputs)
        self.stats = SpecStats(num_speculative_tokens if max_drafts is None else max_drafts)
        for output in outputs:
            if output.finish_reason != "error":
                self.stats.merge(output.stats)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def line(self) -> str:
        parts = [f"{self.generated_tokens} tokens in {self.elapsed_s:.2f} s ({self.tokens_per_s:.1f} tokens/s)"]
        k = self.num_speculative_tokens
        if k == 0:
            parts.append("k=0: no speculation")
        else:
            rates = " ".join(f"{rate:.0%}" if verified else "-" for rate, verified in
                             zip(self.stats.acceptance_rate_per_position, self.stats.verified_per_position))
            tree = f" (tree {','.join(map(str, self.draft_tree))})" if self.draft_tree else ""
            drafter = f" {self.drafter} drafts" if self.drafter not in (None, "mtp") else ""  # MTP: the usual
            parts.append(f"k={k}{drafter}{tree}, acceptance by draft position: {rates}")
            if k == "auto":
                parts.append(f"chosen: {num_drafts_used(self.stats)}")
            if self.stats.tree_steps:
                parts.append(f"{self.stats.tree_steps} steps verified the tree, {self.stats.leaf_steps} ended on a "
                             f"leaf")
            parts.append(f"mean accepted length {self.stats.mean_accepted_length:.2f} tokens/step "
                         f"over {self.stats.steps} steps")
        if self.weight_format:
            parts.append(f"weights: {self.weight_format}")
        if (kernels := cpu_kernels.status()).startswith("not built"):
            parts.append(f"CPU kernels {kernels} (slower fallbacks)")
        if self.errors:
            parts.append(f"{self.errors} of {self.requests} prompts failed")
        return "stats: " + " | ".join(parts)

    def record(self) -> dict:
        return {
            "requests": self.requests,
            "errors": self.errors,
            "generated_tokens": self.generated_tokens,
            "elapsed_s": self.elapsed_s,
            "tokens_per_s": self.tokens_per_s,
            "graph_mode": self.graph_mode,
            "num_speculative_tokens": self.num_speculative_tokens,
            "drafter": self.drafter,
            "draft_tree": list(self.draft_tree) if self.draft_tree else None,
            "stats": stats_record(self.stats),
            "weight_format": self.weight_format,
            "cpu_kernels": cpu_kernels.status(),
        }


def to_json(record: dict) -> str:
    return json.dumps(record, ensure_ascii=False)
