"""compiled-spec: MTP speculative decoding whose every decode-state update is inside the compiled graph."""

import importlib

# The public names load on first use (PEP 562): a process that needs one submodule does not import torch through
# this file. The compile child (engine/compile_worker.py) starts its worker processes before importing torch.
_HOMES = {
    "LLM": ".api", "GraphMode": ".config", "CompiledSpecError": ".errors", "HiSparseConfig": ".hisparse",
    "RequestOutput": ".params", "SamplingParams": ".params", "SpecStats": ".params", "fetch_model": ".loading.registry",
}
__all__ = list(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
