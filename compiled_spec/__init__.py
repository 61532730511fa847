"""compiled-spec: MTP speculative decoding whose every decode-state update is inside the compiled graph."""

from .api import LLM
from .config import GraphMode
from .errors import CompiledSpecError
from .hisparse import HiSparseConfig
from .params import RequestOutput, SamplingParams, SpecStats
from .registry import fetch_model

__all__ = [
    "LLM", "GraphMode", "CompiledSpecError", "HiSparseConfig", "RequestOutput", "SamplingParams", "SpecStats", "fetch_model",
]
