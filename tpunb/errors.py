"""The errors tpunb raises: one class for the package, one for failures inside a rank."""


class TpunbError(Exception):
    """Something would break (or broke) a launch; the message says how to fix it."""


class RankError(TpunbError):
    """A rank failed inside a launch: it raised, was killed by a signal, or sent nothing back.

    ``ranks`` lists the failing ranks; ``remote_traceback`` is the rank's own
    traceback text when it raised (None when it was killed); ``signal`` is the
    signal's name when a process was killed (None otherwise).
    """

    def __init__(self, message, *, ranks, remote_traceback=None, signal=None):
        super().__init__(message)
        self.ranks = tuple(ranks)
        self.remote_traceback = remote_traceback
        self.signal = signal
