"""Grammar engines on this CPU, for structured output: each one's setup over SmolLM2-135M's tokenizer (49,152
tokens), its compile time for a nested JSON schema, and the time to fill one token mask at each token of a valid
output. xgrammar is what the engine uses (engine/structured_output.py); llguidance is measured when installed
(pip install llguidance), else reported absent.

    python -m compiled_spec.benchmarks.grammar_engines [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from compiled_spec import fetch_model
from compiled_spec.loading.tokenizer import load_tokenizer
from .environment import save_run

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city"]}}, "required": ["name", "age", "tags", "address"]}
OUTPUT = {"name": "Ada Lovelace", "age": 36, "tags": ["a", "c"], "address": {"city": "London", "zip": "W1"}}
VOCAB = 49152


def timed_masks(fill, accept, tokens: list[int]) -> list[float]:
    seconds = []
    for token in tokens:
        start = time.perf_counter()
        fill()
        seconds.append(time.perf_counter() - start)
        if not accept(token):
            raise RuntimeError(f"the grammar refused token {token} of a valid output")
    return seconds


def xgrammar_run(tokenizer, tokens):
    import xgrammar

    start = time.perf_counter()
    compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB))
    setup = time.perf_counter() - start
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    compile_s = time.perf_counter() - start
    matcher, bitmask = xgrammar.GrammarMatcher(compiled), xgrammar.allocate_token_bitmask(1, VOCAB)
    return setup, compile_s, timed_masks(lambda: matcher.fill_next_token_bitmask(bitmask), matcher.accept_token, tokens)


def llguidance_run(tokenizer, tokens):
    import llguidance
    import llguidance.hf
    import llguidance.torch

    start = time.perf_counter()
    info = llguidance.hf.from_tokenizer(tokenizer, n_vocab=VOCAB)
    setup = time.perf_counter() - start
    start = time.perf_counter()
    matcher = llguidance.LLMatcher(info, llguidance.LLMatcher.grammar_from_json_schema(
        SCHEMA, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}))
    compile_s = time.perf_counter() - start
    bitmask = llguidance.torch.allocate_token_bitmask(1, VOCAB)
    return setup, compile_s, timed_masks(lambda: llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0),
                                         matcher.consume_token, tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write grammar_engines.json and table.md here")
    args = parser.parse_args()
    tokenizer = load_tokenizer(fetch_model("smollm2-135m"))
    tokens = tokenizer.encode(json.dumps(OUTPUT), add_special_tokens=False)  # both engines write ", " and ": "
    results = {}
    for name, run in (("xgrammar", xgrammar_run), ("llguidance", llguidance_run)):
        try:
            setup, compile_s, seconds = run(tokenizer, tokens)
        except ImportError:
            results[name] = None
            continue
        results[name] = {"tokenizer_setup_s": setup, "schema_compile_ms": 1e3 * compile_s,
                         "mask_us_mean": 1e6 * statistics.mean(seconds),
                         "mask_us_median": 1e6 * statistics.median(seconds),
                         "mask_us_max": 1e6 * max(seconds), "tokens": len(seconds)}
    lines = ["| engine | tokenizer setup (s) | schema compile (ms) | mask µs mean | median | max |",
             "|---|---|---|---|---|---|"]
    for name, row in results.items():
        lines.append(f"| {name} | not installed | | | | |" if row is None else
                     f"| {name} | {row['tokenizer_setup_s']:.2f} | {row['schema_compile_ms']:.1f} | "
                     f"{row['mask_us_mean']:.1f} | {row['mask_us_median']:.1f} | {row['mask_us_max']:.0f} |")
    save_run(args.out, "grammar_engines", {"results": results, "output_tokens": len(tokens)}, "\n".join(lines))


if __name__ == "__main__":
    main()
