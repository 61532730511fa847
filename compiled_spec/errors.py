"""The errors compiled-spec raises on purpose."""


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
