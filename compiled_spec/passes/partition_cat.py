"""Partition cat: rejects a cat or stack whose inputs are computed on different sides of a partition op.

Matches: aten.cat / aten.stack whose input tensors depend on different numbers of partition ops (the ops named in
the custom_should_partition_ops option: attention, in piecewise). Writes nothing: it only reports.

Why: with graph partitions, inductor moves each node into the first partition its inputs allow, and a cat lowered to
one buffer has each input write its own slice of it. When two slices' writers fall in different partitions, each
partition allocates the buffer itself, and one slice is written into a copy nobody reads (on CUDA: garbage in
draft_probs and tokens). Build such a value in one kernel instead (F.pad and torch.where, step.py's stack_depths).
A node's side is the count of partition ops it depends on: the ops of a step form one chain (each attention reads
the hidden state the one before it wrote), so that count is the partition its value can first be computed in.
Safe because it never changes the graph.
"""

from __future__ import annotations

import torch

_CATS = (torch.ops.aten.cat.default, torch.ops.aten.stack.default)
_WRAPPERS = tuple(
    op for name in ("auto_functionalized", "auto_functionalized_v2")
    if (op := getattr(torch.ops.higher_order, name, None)) is not None
)


def _op_name(node: torch.fx.Node) -> str | None:
    target = node.args[0] if node.target in _WRAPPERS else node.target
    schema = getattr(target, "_schema", None)
    return schema.name if schema is not None else None


def _source_line(node: torch.fx.Node) -> str:
    """The innermost compiled_spec frame of the node's stack trace, else the node."""
    trace = node.meta.get("stack_trace") or ""
    frames = [line.strip() for line in trace.splitlines()
              if line.strip().startswith("File") and "compiled_spec" in line]
    return frames[-1] if frames else node.format_node()


def partition_sides(graph: torch.fx.Graph, partition_ops) -> dict[torch.fx.Node, int]:
    """node -> how many partition ops (named in partition_ops) it depends on, itself included."""
    sides: dict[torch.fx.Node, int] = {}
    for node in graph.nodes:  # topological order
        side = max((sides[n] for n in node.all_input_nodes), default=0)
        if node.op == "call_function" and _op_name(node) in partition_ops:
            side += 1
        sides[node] = side
    return sides


class PartitionCatPass:
    name = "partition_cat"

    def __call__(self, graph: torch.fx.Graph, context) -> list[str]:
        partition_ops = set(context.options.get("custom_should_partition_ops") or ())
        if not context.options.get("graph_partition") or not partition_ops:
            return []
        sides = partition_sides(graph, partition_ops)
        problems = []
        for node in graph.nodes:
            if node.op == "call_function" and node.target in _CATS:
                inputs = {sides[n] for n in node.args[0] if isinstance(n, torch.fx.Node)}
                if len(inputs) > 1:
                    problems.append(f"{node.target.overloadpacket.__name__} of values from partitions {sorted(inputs)} "
                                    f"(build it in one kernel: F.pad and torch.where): {_source_line(node)}")
        return problems
