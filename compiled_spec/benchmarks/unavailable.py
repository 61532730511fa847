class Unavailable(Exception):
    """An anchor cannot run on this checkpoint or batch size; the message says why."""
