"""Inductor passes for the compiled speculative step, installed through one SpecPassManager."""

from compiled_spec.errors import GraphAuditError

from .manager import SpecPassManager, default_passes

__all__ = ["GraphAuditError", "SpecPassManager", "default_passes"]
