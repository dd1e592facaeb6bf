"""Errors the serving runtime reports to callers."""


class RequestError(ValueError):
    """A bad ranking request (unknown feature, id out of range, empty candidates, ...).

    Raised before any cached state is touched, so a bad request never changes the cache.
    """
