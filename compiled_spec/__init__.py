"""compiled-spec: MTP speculative decoding whose every decode-state update is inside the compiled graph."""

from .api import LLM
from .config import GraphMode
from .errors import CompiledSpecError
from .params import RequestOutput, SamplingParams, SpecStats

__all__ = ["LLM", "GraphMode", "CompiledSpecError", "RequestOutput", "SamplingParams", "SpecStats"]
