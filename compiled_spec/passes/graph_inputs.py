"""Names for the inputs of a post-grad graph, so passes can say which decode-state field they mean.

Post-grad placeholders only know their position among the traced graph's inputs. The compile
backend records each Dynamo input's source (e.g. L['state'].main_keys[3]) here before lowering; an
ahead-of-time compile records the exported program's inputs (e.g. state.main_keys[3]).
"""

from __future__ import annotations

import contextlib
import contextvars
import re

import torch

_SOURCE_NAMES: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("spec_input_names", default=None)
_STATE_FIELD = re.compile(r"(?:\['state'\]|^state)\.(\w+(?:\.\w+)*(?:\[\d+\])?)")


@contextlib.contextmanager
def named_inputs(source_names: list[str]):
    token = _SOURCE_NAMES.set(source_names)
    try:
        yield
    finally:
        _SOURCE_NAMES.reset(token)


def source_names(gm: torch.fx.GraphModule) -> list[str]:
    names = []
    for node in gm.graph.find_nodes(op="placeholder"):
        grapharg = node.meta.get("grapharg")
        names.append(grapharg.source.name if grapharg is not None and grapharg.source is not None else node.name)
    return names


def state_field(placeholder: torch.fx.Node) -> str | None:
    """The DecodeState field a placeholder carries ('seq_lens', 'main_keys[0]', 'hisparse.hot_keys[0]'), or None."""
    names = _SOURCE_NAMES.get()
    index = getattr(placeholder.meta.get("desc"), "idx", None)
    if names is None or index is None or index >= len(names):
        return None
    match = _STATE_FIELD.search(names[index])
    return match.group(1) if match else None


def is_branch_graph(graph: torch.fx.Graph) -> bool:
    """A control-flow op's branch (torch.cond's true/false graphs). Inductor runs the post-grad passes on each
    branch first, as a graph of its own; unlike a compiled graph's, a branch's inputs carry no AOT descriptor."""
    placeholders = graph.find_nodes(op="placeholder")
    return bool(placeholders) and all("desc" not in node.meta for node in placeholders)
