"""Audit: rejects a step graph that could go wrong under graph replay.

Matches: host-synchronising ops (.item(), nonzero, masked_select, unique, ...), values whose shape
depends on data (unbacked symbols), tensors returned to Python (state for the caller to apply), and
declared state that does not enter the graph as an input (a Python value baked in where a state
tensor belongs). Writes nothing: it only raises GraphAuditError. Safe because it never changes the graph.
"""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from .graph_inputs import state_field

HOST_SYNC_OPS = {"_local_scalar_dense", "item", "nonzero", "masked_select", "_unique", "_unique2", "unique_dim", "unique_consecutive"}


def _is_host_sync(node: torch.fx.Node) -> bool:
    packet = getattr(node.target, "overloadpacket", None)
    return packet is not None and packet.__name__ in HOST_SYNC_OPS


def _tensor_outputs(graph: torch.fx.Graph) -> list[str]:
    output = graph.find_nodes(op="output")[0]
    leaves = torch.utils._pytree.tree_leaves(output.args)
    return [leaf.name for leaf in leaves if isinstance(leaf, torch.fx.Node)]


class AuditPass:
    name = "audit"

    def __call__(self, graph: torch.fx.Graph, context) -> list[str]:
        problems = self.check_branch(graph)
        returned = _tensor_outputs(graph)
        if returned:
            problems.append(f"returns tensors to Python (state for the caller to apply): {', '.join(returned)}")
        inputs = {state_field(node) for node in graph.find_nodes(op="placeholder")}
        missing = [name for name in context.state_writes if name not in inputs]
        if missing:
            problems.append(f"decode state that is not a graph input (baked in as a Python value?): {', '.join(missing)}")
        return problems

    def check_branch(self, graph: torch.fx.Graph) -> list[str]:
        """What can go wrong inside any graph, a control-flow branch's included (which returns to its enclosing
        graph, not to Python, and reaches the decode state only through it)."""
        problems = []
        for node in graph.nodes:
            if node.op == "call_function" and _is_host_sync(node):
                problems.append(f"host sync: {node.format_node()}")
            elif node.op == "call_function" and free_unbacked_symbols(node.meta.get("val")):
                problems.append(f"data-dependent shape: {node.format_node()}")
        return problems
