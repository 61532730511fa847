"""What cuts inductor's compile time must leave the compiled code as it was."""

from __future__ import annotations

import torch
from torch._inductor.codegen.common import KernelTemplate

from compiled_spec.config import GraphMode
from compiled_spec.runtime.graph_modes import inductor_options, spec_backend
from compiled_spec.runtime.inductor_compile_time import REALIZE_OPCOUNT_THRESHOLD
from compiled_spec.speculative import rng
from passes import SpecPassManager
from passes.manager import PassContext


def test_a_kernel_template_source_is_parsed_once_and_renders_as_before():
    source = "{{ name }}({{ args | join(', ') }})"
    parsed = KernelTemplate._template_from_string(source)
    assert KernelTemplate._template_from_string(source) is parsed
    assert parsed.render(name="gemm", args=["X", "W"]) == "gemm(X, W)"
    assert parsed.render(name="mm", args=["A"]) == "mm(A)"


def test_the_sampler_hash_compiled_with_early_realization_equals_eager():
    options = inductor_options(GraphMode.COMPILE, torch.device("cpu"))
    assert options["realize_opcount_threshold"] == REALIZE_OPCOUNT_THRESHOLD

    def draw(seeds, positions):
        return rng.uniforms(rng.stream_key(seeds[:, None], positions, rng.DRAFT + 1), 4096)

    manager = SpecPassManager([], PassContext(graph_name="draw", state_writes=(), options=options))
    compiled = torch.compile(draw, fullgraph=True, dynamic=False, backend=spec_backend(options, manager))
    seeds = torch.tensor([0, 2**40 + 7, 2**63 - 1])
    positions = torch.arange(12).view(3, 4)
    assert torch.equal(compiled(seeds, positions), draw(seeds, positions))
