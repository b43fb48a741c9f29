"""The errors a user can act on (a failed download, a checksum, a missing optional dependency).

The command line prints these, and ``ValueError``, ``FileNotFoundError`` and ``FloatingPointError``, as one
line; any other exception is a bug and keeps its traceback.
"""


class PadError(RuntimeError):
    """A failure with a clear cause outside pad's code: the message says what to do."""
