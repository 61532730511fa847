"""The partition-cat audit (passes/partition_cat.py) on small traced graphs: a cat or stack of values from two sides
of a partition op is rejected, the same value built with F.pad and torch.where passes. (The real step graphs go
through it in every compiled mode's tests: it is one of the default passes.)"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from compiled_spec.passes.manager import PassContext, default_passes
from compiled_spec.passes.partition_cat import PartitionCatPass

OPTIONS = {"graph_partition": True, "custom_should_partition_ops": ["partition_cat_test::attend"]}


@torch.library.custom_op("partition_cat_test::attend", mutates_args=())
def attend(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@attend.register_fake
def _(x):
    return torch.empty_like(x)


def problems(function, options=OPTIONS):
    graph = make_fx(function)(torch.randn(2, 4), torch.randn(2, 1, 4)).graph
    return PartitionCatPass()(graph, PassContext("toy", (), options))


def two_depths(x, carry):
    first = attend(x.sin())
    second = attend(first + 1)
    return first, second, carry


def test_a_stack_across_a_partition_op_is_rejected():
    def stacked(x, carry):
        first, second, _ = two_depths(x, carry)
        return torch.stack([first, second], dim=1)

    found = problems(stacked)
    assert len(found) == 1 and "stack of values from partitions [1, 2]" in found[0]


def test_a_cat_of_state_and_a_value_after_attention_is_rejected():
    def carried(x, carry):
        first, _, carry = two_depths(x, carry)
        return torch.cat([carry, first[:, None]], dim=1)

    assert "cat of values from partitions [0, 1]" in problems(carried)[0]


def test_one_kernel_versions_pass():
    def one_kernel(x, carry):
        first, second, carry = two_depths(x, carry)
        index = torch.arange(2)[None, :, None]
        stacked = torch.where(index == 1, second[:, None], first[:, None].expand(2, 2, 4))
        prepended = torch.where(index == 0, carry, F.pad(first[:, None], (0, 0, 1, 0)))
        same_side = torch.cat([first, first * 3], dim=1)  # both after the first call: one partition
        return stacked, prepended, same_side

    assert problems(one_kernel) == []


def test_without_partitions_it_checks_nothing():
    def stacked(x, carry):
        first, second, _ = two_depths(x, carry)
        return torch.stack([first, second], dim=1)

    assert problems(stacked, {}) == []
    assert problems(stacked, {**OPTIONS, "graph_partition": False}) == []
    assert any(isinstance(p, PartitionCatPass) for p in default_passes())
