"""Shared fixtures: tiny transformers-written checkpoints, each written once per test session (per xdist worker)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tiny_checkpoints import write_checkpoint

# Tiny models run fastest on one thread, and the suite runs one worker per core (pytest -n 2).
torch.set_num_threads(1)
# A test that does not name a graph mode runs the reference, eager, in this process and in the CLIs and servers it
# starts (the default, full, starts a background compile on CPU); test_default_graph_mode checks the real default.
os.environ["COMPILED_SPEC_GRAPH_MODE"] = "eager"
# pytest -n 2 already keeps every core busy, and a test that patches the step must compile it in its own process:
# full compiles in this process unless a test asks for compile processes (test_tiered_start, test_graph_modes).
os.environ["COMPILED_SPEC_COMPILE_WORKERS"] = "1"



@pytest.fixture(scope="session", autouse=True)
def cpu_kernels_built():
    """Eager passes use the C++ kernels only where they are already built (a fresh machine decodes with the ATen
    fallbacks until a compile builds them). Built first, every test's eager reference uses them whichever test ran
    before it; test_first_text starts fresh machines of its own."""
    from compiled_spec.model import cpu_kernels

    cpu_kernels.load()


LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
}
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}

# name -> write_checkpoint arguments. Add a line for a new variant.
CHECKPOINTS = {
    "llama": dict(architecture="llama"),
    "llama_tied": dict(architecture="llama", tie_word_embeddings=True),
    "llama_bias": dict(architecture="llama", attention_bias=True),
    "llama_rope_llama3": dict(architecture="llama", rope_parameters=LLAMA3_ROPE),
    "llama_sharded": dict(architecture="llama", max_shard_size="40KB"),
    "llama_mimo": dict(architecture="llama", layout="mimo"),
    "llama_mtp_indexed": dict(architecture="llama", layout="mtp-indexed"),
    "qwen3_mtp_flat": dict(architecture="qwen3", layout="mtp-flat", num_mtp_modules=1),
    "llama_no_mtp": dict(architecture="llama", num_mtp_modules=0),
    "qwen2": dict(architecture="qwen2"),
    "qwen2_yarn": dict(architecture="qwen2", rope_parameters=YARN_ROPE),
    "qwen3": dict(architecture="qwen3"),
    "glm4_moe": dict(architecture="glm4_moe"),
    "glm4_moe_bias": dict(architecture="glm4_moe", attention_bias=True, tie_word_embeddings=True),
    # MTP modules that mimic the main model: drafts are accepted about half the time, so steps
    # accept none, some and all of their drafts.
    "predictive": dict(architecture="llama", num_hidden_layers=1, mtp_noise=0.1),
    "predictive_moe": dict(architecture="glm4_moe", num_hidden_layers=1, first_k_dense_replace=0, mtp_noise=0.1),
    # A vocabulary small enough that sampled-token histograms are dense; random MTP modules, so
    # drafts are often rejected and the residual distribution matters.
    "tiny_vocab": dict(architecture="llama", vocab_size=6, num_hidden_layers=1, eos_token_id=5, bos_token_id=4),
}


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    model: torch.nn.Module  # the transformers model the checkpoint was saved from
    mtp_layers: list  # transformers MtpLayer modules, in depth order


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """tiny_checkpoint(name) -> Checkpoint, written on first use (see CHECKPOINTS)."""
    written: dict[str, Checkpoint] = {}

    def get(name: str) -> Checkpoint:
        if name not in written:
            path = tmp_path_factory.mktemp(name)
            model, layers = write_checkpoint(path, **CHECKPOINTS[name])
            written[name] = Checkpoint(path, model, layers)
        return written[name]

    return get


def pytest_collection_modifyitems(config, items):
    """Tests marked `slow` come first (in their own order), so pytest -n 2 hands them out before the quick ones and
    neither worker is left with a long compile at the end. Tests marked `cuda` need a GPU; without one they are
    skipped, not failed."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
