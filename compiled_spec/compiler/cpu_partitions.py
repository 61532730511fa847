"""Graph partitions on CPU: piecewise on CPU runs the partition code that piecewise on CUDA replays.

On CUDA, piecewise splits each graph at the partition ops (attention) into partition functions that cudagraph trees
capture. Inductor makes partitions only for CUDA graphs: with triton.cudagraphs off, or on CPU, every node stays in
one `call` function, so a CPU run never executed the partition code, and a fault in it (a value assembled from pieces
computed in two partitions, each partition allocating its own copy of the buffer) was seen only on a GPU.

Inside `partitions_on_cpu()`, a CPU compile partitions as CUDA's does: only the partition ops split the graph,
triton.cudagraphs is on (so the same node reordering runs), and each partition function is wrapped by an identity
wrapper where CUDA would capture it. The compiled code is the CUDA partition code less the capture.
"""

from __future__ import annotations

import contextlib

from . import torch_patches

# Changes when the partition code this makes changes (it is part of the pass manager's cache key).
VERSION = "1"
PARTITION_OPS = ("compiled_spec::cached_attention", "compiled_spec::hisparse_attention")


def _only_at_partition_ops(original, scheduler, node):
    # Inductor's other reasons (a CPU node; any node while cudagraphs are off) would split at every node.
    reason = original(scheduler, node)
    return reason if reason is not None and reason.startswith("custom partition op") else None


# The number of partition functions of each graph compiled (or loaded from the FX graph cache) inside
# partitions_on_cpu, in order: a graph split at n partition ops has up to n + 1.
partitions_per_graph: list[int] = []


def _identity_wrapper(function, metadata):
    if metadata.partition_index == 0:
        partitions_per_graph.append(metadata.num_partitions)
    return function


@contextlib.contextmanager
def partitions_on_cpu():
    """Compiles made inside partition CPU graphs at the partition ops (the inductor options must name them in
    custom_should_partition_ops and set graph_partition and triton.cudagraphs)."""
    with torch_patches.partitions_where(_only_at_partition_ops, _identity_wrapper):
        yield
