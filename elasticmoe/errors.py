"""Errors the engine raises for bad input. Each names the offending field so the
HTTP layer can answer 400 with OpenAI's `param` set."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message

    def __reduce__(self):
        # Crosses process boundaries (Ray actors) with `.param` intact: the default
        # pickling would call the constructor with the formatted message only.
        return (type(self), (self.param, self.message))


class UnknownAdapterError(InvalidRequestError):
    """A request names an adapter (in `model`) that is not loaded: HTTP 404, like an unknown model."""

    def __init__(self, adapter: str) -> None:
        super().__init__("model", f"adapter {adapter!r} is not loaded")
        self.adapter = adapter

    def __reduce__(self):
        return (type(self), (self.adapter,))


class AdapterError(InvalidRequestError):
    """A bad adapter or adapter option; `.param` names the offending field. Here, not beside the
    adapter formats, so that the admin routes and `adapters.kinds` raise and map it without
    importing them (and torch)."""


class AdapterLimitError(RuntimeError):
    """No free adapter slot, or an adapter needs more experts per layer than a slot holds (HTTP 409)."""


class AdapterConflictError(RuntimeError):
    """An adapter of that name is already loaded, or still unloading (HTTP 409)."""


class AdapterUnavailableError(RuntimeError):
    """A rank did not answer an adapter change in time, or died during it (HTTP 503: retry once
    the server has healed). What the change had done is undone where the ranks still answer."""


def unwrap_remote(exc: BaseException) -> BaseException:
    """The original exception of one re-raised in another process: Ray's `RayTaskError` keeps it
    as `.cause`, and its own text is the remote traceback, which must never reach a client."""
    for _ in range(8):  # a cause chain through a few actors, never a cycle
        cause = getattr(exc, "cause", None)
        if not isinstance(cause, BaseException):
            break
        exc = cause
    return exc


def describe_error(exc: BaseException) -> str:
    """`Type: first line of the message` of the original exception (for status pages and logs
    that users read: no traceback, no remote frames)."""
    original = unwrap_remote(exc)
    lines = str(original).strip().splitlines()
    return f"{type(original).__name__}: {lines[0] if lines else ''}".rstrip(": ")
