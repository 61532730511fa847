class CompiledSpecError(ValueError):
    """A problem with the user's input: the message names the bad value and what is allowed.

    The CLI prints these without a traceback.
    """
