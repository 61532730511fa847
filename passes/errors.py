class GraphAuditError(RuntimeError):
    """A compiled step graph breaks an invariant: it syncs with the host, has data-dependent shapes,
    hands state back to Python, or updates state outside the graph."""
