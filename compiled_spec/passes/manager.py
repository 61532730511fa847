"""One pass manager, installed as inductor's post_grad_custom_post_pass.

Inductor's FX graph cache skips custom passes on a hit, so uuid() must change whenever any pass
or its configuration would change the result: it hashes every pass's source file and the context.
"""

from __future__ import annotations

import hashlib
import inspect
from dataclasses import dataclass, field

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from compiled_spec.errors import GraphAuditError

from .audit import AuditPass
from .graph_inputs import is_branch_graph
from .partition_cat import PartitionCatPass
from .state_mutation import StateMutationPass


@dataclass
class PassContext:
    graph_name: str
    state_writes: tuple[str, ...]
    options: dict = field(default_factory=dict)
    last_written: list[str] = field(default_factory=list)

    def cache_key(self) -> str:
        return repr((self.graph_name, self.state_writes, sorted(self.options.items())))


class SpecPassManager(CustomGraphPass):
    def __init__(self, passes: list, context: PassContext):
        self.passes = list(passes)
        self.context = context
        self.graphs_seen: list[str] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        problems = []
        branch = is_branch_graph(graph)
        for graph_pass in self.passes:
            if not branch:
                problems += graph_pass(graph, self.context) or []
            elif hasattr(graph_pass, "check_branch"):
                problems += graph_pass.check_branch(graph)
        if problems:
            raise GraphAuditError(f"{self.context.graph_name}{' (a branch)' if branch else ''}: " + "; ".join(problems))
        graph.lint()
        if not branch:
            self.graphs_seen.append(self.context.graph_name)

    def uuid(self) -> str:
        digest = hashlib.sha256()
        for graph_pass in self.passes:
            digest.update(inspect.getsource(type(graph_pass)).encode())
            digest.update(inspect.getsource(inspect.getmodule(type(graph_pass))).encode())
            digest.update(getattr(graph_pass, "cache_key", lambda: "")().encode())  # what else its output depends on
        digest.update(inspect.getsource(inspect.getmodule(SpecPassManager)).encode())
        digest.update(self.context.cache_key().encode())
        return digest.hexdigest()


def default_passes(hisparse=None) -> list:
    """The audit, partition-cat and state-mutation passes; with a HiSparseConfig, the HiSparse fusion pass first."""
    passes = [AuditPass(), PartitionCatPass(), StateMutationPass()]
    if hisparse is not None:
        from .hisparse_fusion import HiSparseFusionPass

        passes.insert(0, HiSparseFusionPass(hisparse))
    return passes
