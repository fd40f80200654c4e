"""Errors of the serving runtime; the HTTP layer maps each to one status in one handler.

    ServerError
     ├── PoolSaturated          queue full: 429 + Retry-After
     ├── ExpertUnavailable      an expert cannot be loaded (checksum, missing file), or a
                                hyper store's hypernetwork (named): 503 (+ Retry-After
                                while the bad file is remembered)
     ├── NotReady               store or pool not up yet (or shutting down): 503
     ├── PoolClosed             the pool was closed while work was pending: 503
     ├── ActorFailed            an actor died and the retry failed too: 503
     ├── PoolStartFailed        the actors could not be placed at startup (a startup error)
     ├── RequestTimeout         the answer did not come in time: 504
     ├── InvalidRequest         a request the router or pool refuses: 422
     │    └── CapExceeded       a gate setting beyond a server cap (names the cap): 422
     ├── UnknownStoreKind       a store of a kind this server cannot serve (startup, reload)
     ├── StoreNotServable       a store whose files disagree with each other or its manifest
     │                          in a way its kind cannot serve (startup, reload)
     └── HttpError              a request the HTTP layer refuses while reading it, with its
                                own status and code (413 body too large, 415, 408, 401, ...)
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ActorFailed",
    "CapExceeded",
    "ExpertUnavailable",
    "HttpError",
    "InvalidRequest",
    "NotReady",
    "PoolClosed",
    "PoolSaturated",
    "PoolStartFailed",
    "RequestTimeout",
    "ServerError",
    "StoreNotServable",
    "UnknownStoreKind",
]


class ServerError(Exception):
    """Base of every error the serving runtime raises on purpose."""

    def __init__(self, message: str, **fields: Any) -> None:
        super().__init__(message)
        self.message = message
        self.fields = fields
        for key, value in fields.items():
            setattr(self, key, value)

    def __reduce__(self) -> tuple[Any, ...]:
        # Subclasses take keyword-only fields, so the default (cls, args) cannot rebuild one
        # where it is unpickled (a Ray task's error reached the driver as "Failed to
        # deserialize exception"): rebuilt from its args and fields as they are.
        return _rebuilt, (type(self), self.args, self.__dict__)


class PoolSaturated(ServerError):
    def __init__(self, *, queued_rows: int, max_queue_rows: int, retry_after_s: float) -> None:
        super().__init__(
            f"the serving queue is full ({queued_rows} of {max_queue_rows} rows); retry later",
            queued_rows=queued_rows,
            max_queue_rows=max_queue_rows,
            retry_after_s=retry_after_s,
        )
        self.retry_after_s = retry_after_s


class ExpertUnavailable(ServerError):
    def __init__(
        self,
        *,
        expert_id: int,
        reason: str,
        node: str | None = None,
        retry_after_s: float | None = None,
        hypernetwork: str | None = None,
    ) -> None:
        # `node`: the graph node the expert serves (graph stores), named in the message.
        # `retry_after_s`: when the pool will read a remembered bad file again (Retry-After).
        # `hypernetwork`: the file of a hyper store's f when f itself cannot be read: then no
        # θ can be generated, whichever condition's (`expert_id`) the request needed, and the
        # message names f, not "expert 0" or the loader's stand-in "expert -1".
        if hypernetwork is None:
            hypernetwork = _hypernetwork_named(reason)
        if hypernetwork is not None:
            message = f"no expert can be generated: {reason}"
        else:
            where = "" if node is None else f"node {node!r} "
            message = f"{where}expert {expert_id} cannot be served: {reason}"
        super().__init__(
            message, expert_id=expert_id, reason=reason, node=node,
            retry_after_s=retry_after_s, hypernetwork=hypernetwork,
        )
        self.expert_id = expert_id
        self.reason = reason
        self.node = node
        self.retry_after_s = retry_after_s
        self.hypernetwork = hypernetwork


# How a hyper store's f failure is told (experts_store's `own_file_problem` with the label
# `hypernetwork <file>`, as server.pool's `load_error` and kind hyper's generator give it).
_HYPERNETWORK_LABEL = "hypernetwork "


def _hypernetwork_named(reason: str) -> str | None:
    """The file of the hypernetwork a load failure's `reason` is about, or None when it is
    about something else (an expert's file).

    Read from the text because a failed load crosses the actors' boundary as text only: the
    group's error is a string by the time a request's `ExpertUnavailable` is built."""
    if not reason.startswith(_HYPERNETWORK_LABEL):
        return None
    name, sep, _ = reason[len(_HYPERNETWORK_LABEL):].partition(": ")
    # A store names its files without blanks or colons (`hyper-<sha256[:16]>.safetensors`).
    if not sep or not name or any(c in name for c in " :/"):
        return None
    return name


class NotReady(ServerError):
    def __init__(self, *, reason: str) -> None:
        super().__init__(f"not ready: {reason}", reason=reason)


class PoolClosed(ServerError):
    def __init__(self) -> None:
        super().__init__("the expert pool is shut down")


class ActorFailed(ServerError):
    def __init__(self, *, actor: str, reason: str) -> None:
        super().__init__(f"actor {actor} failed: {reason}", actor=actor, reason=reason)


class PoolStartFailed(ServerError):
    def __init__(self, *, reason: str) -> None:
        super().__init__(f"the actor pool could not start: {reason}", reason=reason)


class RequestTimeout(ServerError):
    def __init__(self, *, timeout_s: float) -> None:
        super().__init__(f"no answer within {timeout_s:g} s", timeout_s=timeout_s)


class InvalidRequest(ServerError):
    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message, field=field)


class CapExceeded(InvalidRequest):
    """A request asked for more than a server-side cap allows (Settings `cap`)."""

    def __init__(
        self, *, cap: str, limit: float, value: object, field: str, allowed: str | None = None
    ) -> None:
        # `allowed` states the range where the cap bounds one from both sides or is relative.
        message = (
            f"{field}={value!r} exceeds the server cap {cap}={limit!r}"
            if allowed is None
            else f"{field}={value!r} is outside {allowed} (server cap {cap}={limit!r})"
        )
        range_ = {} if allowed is None else {"allowed": allowed}
        ServerError.__init__(
            self, message, field=field, cap=cap, limit=limit, value=value, **range_
        )


class UnknownStoreKind(ServerError):
    def __init__(self, *, kind: str, known: list[str]) -> None:
        super().__init__(
            f"store kind {kind!r} is not one this server can serve (known: {', '.join(known)})",
            kind=kind,
            known=known,
        )


class StoreNotServable(ServerError):
    """The store's files are each readable but do not fit together (a router of K prototypes
    for K+1 experts, a conditions table of the wrong width): nothing it answered would be
    right, so it never goes live."""

    def __init__(self, *, kind: str, reason: str) -> None:
        super().__init__(f"{reason} (a store of kind {kind!r})", kind=kind, reason=reason)


class HttpError(ServerError):
    """An error found while reading a request, already carrying its HTTP status and code."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        detail: Any = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.detail = detail
        self.headers = headers or {}


def _rebuilt(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> Any:
    exc = cls.__new__(cls, *args)
    exc.args = args
    exc.__dict__.update(state)
    return exc
