"""Errors the serving runtime reports to callers."""


class RequestError(ValueError):
    """A bad request (unknown feature, id out of range, empty candidates, ...); the message starts
    with the request field it is about.

    Raised before any cached state is touched, so a bad request never changes the cache.
    """

    @property
    def field(self) -> str:
        """The request field the message names (its text before the first ': ')."""
        head, sep, _ = str(self).partition(": ")
        return head if sep and " " not in head else ""


class ScoringError(RuntimeError):
    """The model produced non-finite scores: a server-side fault, never returned as NaN."""


class IdMapError(RuntimeError):
    """The export's id maps cannot be read, so raw ids cannot be served: a server-side fault."""
