"""The errors compiled-spec raises on purpose."""

from typing import Any

SHOWN_VALUE_CHARACTERS = 100  # an echoed value is cut to this many characters


def shown(value: Any) -> str:
    """repr(value) as an error message echoes it: cut to SHOWN_VALUE_CHARACTERS characters, marked with '…'."""
    try:
        text = repr(value)
    except ValueError:  # an int past Python's int-string limit
        text = f"<{type(value).__name__}>"
    return text if len(text) <= SHOWN_VALUE_CHARACTERS else text[:SHOWN_VALUE_CHARACTERS] + "…"


class CompiledSpecError(ValueError):
    """A problem with the user's input: the message names the bad value and what is allowed.

    `param` names the offending field where there is one (the server reports it as the error's param).
    The CLI prints these without a traceback.
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class GraphAuditError(RuntimeError):
    """A compiled step graph breaks an invariant: it syncs with the host, has data-dependent shapes,
    hands state back to Python, or updates state outside the graph (raised by the passes)."""
