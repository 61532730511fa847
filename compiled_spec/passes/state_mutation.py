"""State mutation: every declared decode-state update is an in-graph write into its persistent buffer.

Matches: after AOT functionalization, an update of an input buffer that stays in the graph is an
`aten.copy_(placeholder, new_value)` (inductor then re-inplaces it into index_put_/index_copy_ on the
buffer itself). An update that AOT could not keep in the graph becomes a graph output that Python
copies back after the call; under graph replay that copy is exactly what goes stale.
Writes: nothing; it records which buffers are written (for tests and reports) and reports each
declared update that is not an in-graph mutation.
"""

from __future__ import annotations

import torch

from .graph_inputs import state_field

aten = torch.ops.aten


def mutated_placeholders(graph: torch.fx.Graph) -> dict[str, torch.fx.Node]:
    mutated = {}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        schema = getattr(node.target, "_schema", None)
        if schema is None:
            continue
        for argument, value in zip(schema.arguments, node.args):
            written = argument.alias_info is not None and argument.alias_info.is_write
            if written and isinstance(value, torch.fx.Node) and value.op == "placeholder":
                mutated[value.name] = value
    return mutated


class StateMutationPass:
    name = "state_mutation"

    def __call__(self, graph: torch.fx.Graph, context) -> list[str]:
        written = {state_field(node) for node in mutated_placeholders(graph).values()}
        context.last_written = sorted(name for name in written if name)
        missing = [name for name in context.state_writes if name not in written]
        if missing:
            return [f"decode state updated outside the graph: {', '.join(missing)}"]
        return []
