"""HiSparse fusion: the decomposed sparse attention of a decode pass -> one `compiled_spec::hisparse_attention`.

Matches: the subgraph that compiled_spec/hisparse/reference.py:sparse_attention lowers to (indexer
scores, top-k, residency resolve, swap-in, gathers, attention), one per tiered layer, found with
inductor's pattern matcher: the reference is traced into an aten pattern the way inductor has shaped
the graph by then (scalars as `full`, views as reshapes; a second variant with freezing's CSE), with
sizes ignored and nodes allowed to feed other layers too; a match must select top_k_tokens tokens.
Writes: the fused op in place of the subgraph. The op returns the same five values (output and the
four hot tiers); the copies of the tiers into their persistent buffers stay in the graph as they were.
Why it is safe: the op computes what the reference computes (tests/test_hisparse.py checks both on
random tiers, and the compiled step against eager), it reads only the matched subgraph's inputs, and
it has no side effects. Unmatched graphs are left alone. It reports no problems.
uuid: the manager hashes this file; cache_key() adds the reference, the fused op and the HiSparse
config (top_k_tokens is part of the pattern).
"""

from __future__ import annotations

import functools
import inspect
import itertools
from functools import partial

import torch
from torch._functorch.compile_utils import fx_graph_cse
from torch._inductor.fx_passes.joint_graph import constant_fold_uniform_value
from torch._inductor.fx_passes.post_grad import view_to_reshape
from torch._inductor.pattern_matcher import (
    MULTIPLE,
    Match,
    MultiOutputPattern,
    PatternExpr,
    PatternMatcherPass,
    _TargetArgsExpr,
    fwd_only,
    gen_pattern,
    register_graph_pattern,
    stable_topological_sort,
)
from torch.utils import _pytree as pytree

from compiled_spec.hisparse import fused, reference


def _top_k(config, index_keys) -> int:
    return min(config.top_k_tokens, index_keys.shape[1])


# Search and replacement, with lightning-indexer head weights (index_w) and without (the training-free scorer).
def _search_weighted(config, q, new_keys, new_values, index_q, index_w, index_keys, cold_keys, cold_values,
                     hot_keys, hot_values, hot_positions, hot_last_used, write_positions, attend, clock, live):
    return reference.sparse_attention(
        q, new_keys, new_values, index_q, index_w, index_keys, cold_keys, cold_values, hot_keys, hot_values,
        hot_positions, hot_last_used, write_positions, attend, clock, live, _top_k(config, index_keys),
    )


def _replace_weighted(config, q, new_keys, new_values, index_q, index_w, index_keys, cold_keys, cold_values,
                      hot_keys, hot_values, hot_positions, hot_last_used, write_positions, attend, clock, live):
    return fused.hisparse_attention(
        q, new_keys, new_values, index_q, index_w, index_keys, cold_keys, cold_values, hot_keys, hot_values,
        hot_positions, hot_last_used, write_positions, attend, clock, live, _top_k(config, index_keys),
    )


def _search_unweighted(config, q, new_keys, new_values, index_q, index_keys, cold_keys, cold_values,
                       hot_keys, hot_values, hot_positions, hot_last_used, write_positions, attend, clock, live):
    return reference.sparse_attention(
        q, new_keys, new_values, index_q, None, index_keys, cold_keys, cold_values, hot_keys, hot_values,
        hot_positions, hot_last_used, write_positions, attend, clock, live, _top_k(config, index_keys),
    )


def _replace_unweighted(config, q, new_keys, new_values, index_q, index_keys, cold_keys, cold_values,
                        hot_keys, hot_values, hot_positions, hot_last_used, write_positions, attend, clock, live):
    return fused.hisparse_attention(
        q, new_keys, new_values, index_q, None, index_keys, cold_keys, cold_values, hot_keys, hot_values,
        hot_positions, hot_last_used, write_positions, attend, clock, live, _top_k(config, index_keys),
    )


def example_inputs(dtype=torch.float32, weighted=True, cold_dtype=None, batch=2, length=3, heads=4, kv_heads=2,
                   dim=8, index_heads=2, index_dim=8, capacity=16, hot_rows=6):
    """Inputs for tracing the pattern (values do not matter, only dtypes and layouts)."""
    def floats(*shape, dtype=dtype):
        return torch.randn(*shape, dtype=dtype)

    def cold(*shape):
        return floats(*shape, dtype=cold_dtype or dtype)

    def ints(*shape):
        return torch.zeros(*shape, dtype=torch.int64)

    index_w = [floats(batch, length, index_heads)] if weighted else []
    return [
        floats(batch, length, heads, dim), floats(batch, length, kv_heads, dim), floats(batch, length, kv_heads, dim),
        floats(batch, length, index_heads, index_dim), *index_w,
        floats(batch, capacity, index_dim), cold(batch, capacity, kv_heads, dim), cold(batch, capacity, kv_heads, dim),
        floats(batch, hot_rows + 1, kv_heads, dim), floats(batch, hot_rows + 1, kv_heads, dim),
        ints(batch, hot_rows + 1), ints(batch, hot_rows + 1), ints(batch, length),
        torch.ones(batch, length, capacity, dtype=torch.bool), ints(batch), torch.ones(batch, dtype=torch.bool),
    ]


def trace_like_inductor(function, args, **kwargs) -> torch.fx.GraphModule:
    """fwd_only, then the rewrites inductor applies before post-grad custom passes run (scalar constants
    become `full`, views become reshapes), so the pattern looks like the graphs it is matched in."""
    gm = fwd_only(function, args, **kwargs)
    constant_fold_uniform_value(gm)
    view_to_reshape(gm)
    gm.recompile()
    return gm


def trace_like_inductor_freezing(function, args, **kwargs) -> torch.fx.GraphModule:
    """trace_like_inductor, then the common-subexpression elimination that freezing (`full` mode on CPU) adds."""
    gm = trace_like_inductor(function, args, **kwargs)
    gm.graph = fx_graph_cse(gm.graph)
    gm.recompile()
    return gm


@functools.lru_cache(maxsize=None)
def _patterns(config, dtype: torch.dtype) -> PatternMatcherPass:
    """The replacement rules for one HiSparse config and model dtype (tracing them takes a few seconds); the cold
    pool has the config's cold dtype, so a compact pool's conversions are part of the pattern."""
    patterns = PatternMatcherPass(pass_name="hisparse_fusion")
    for weighted, trace in itertools.product((True, False), (trace_like_inductor, trace_like_inductor_freezing)):
        search, replace = (_search_weighted, _replace_weighted) if weighted else (_search_unweighted, _replace_unweighted)
        search, replace = partial(search, config), partial(replace, config)
        inputs = example_inputs(dtype, weighted, cold_dtype=config.cold_torch_dtype(dtype))
        pattern = _allow_shared_nodes(gen_pattern(search, inputs, trace))
        # A graph pattern, not register_replacement: from torch 2.15 that re-traces the search function at each match
        # into a pattern whose nodes may not feed other layers, so a freezing graph's shared nodes never match.
        register_graph_pattern(pattern, extra_check=partial(_selects_top_k, config), pass_dict=patterns)(
            partial(_replace_match, replace, list(inspect.signature(search).parameters)))
    return patterns


def _replace_match(replace, argnames: list[str], match: Match, *args, **kwargs) -> None:
    match.replace_by_example(replace, [kwargs[name] for name in argnames])


def _allow_shared_nodes(pattern: PatternExpr) -> PatternExpr:
    """Lets every node of the pattern have users outside it.

    Layers of one pass share their positions, masks and clock, and freezing deduplicates what is
    computed from them (and every scalar constant), so a node of one layer's subgraph may feed another
    layer's too. Such a node stays in the graph after the replacement (only nodes left without users
    are removed), so matching it is safe.
    """
    seen, stack = set(), [pattern]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, MultiOutputPattern):
            stack.extend(output for output in node.outputs if output is not None)
        elif isinstance(node, _TargetArgsExpr):
            node.users = MULTIPLE
            stack.extend(arg for arg in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(arg, PatternExpr))
    return pattern


def _selects_top_k(config, match: Match) -> bool:
    """Sizes are not part of the pattern: check that the match selects as many tokens as configured."""
    capacity = match.kwargs["index_keys"].meta["val"].shape[1]
    top_k = [node.args[1] for node in match.nodes if node.target is torch.ops.aten.topk.default]
    return top_k == [min(config.top_k_tokens, capacity)]


def _float_dtypes(graph: torch.fx.Graph) -> set[torch.dtype]:
    values = (node.meta.get("val") for node in graph.find_nodes(op="placeholder"))
    return {value.dtype for value in values if isinstance(value, torch.Tensor) and value.is_floating_point()}


class HiSparseFusionPass:
    name = "hisparse_fusion"

    def __init__(self, config):
        self.config = config
        self.matches = 0  # replacements made, over every graph this pass has seen

    def __call__(self, graph: torch.fx.Graph, context) -> list[str]:
        matched = sum(_patterns(self.config, dtype).apply(graph) for dtype in sorted(_float_dtypes(graph), key=str))
        if matched:
            # The op goes where the subgraph's first output was; inputs computed later move up in front of it.
            stable_topological_sort(graph)
            graph.eliminate_dead_code()
        self.matches += matched
        return []

    def cache_key(self) -> str:
        return repr(self.config) + inspect.getsource(reference) + inspect.getsource(fused)
