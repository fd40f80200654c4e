"""The pool floor's own errors. None reaches a request: the pool answers each as a
`server._exceptions` error (`ActorFailed`, `ExpertUnavailable`) or recovers from it.

    ActorDied(actor)          a call found its actor dead (Ray's RayActorError, the fake's kill)
     └── ActorGone            ... and its runtime will not restart it (restarts spent)
    ChannelError              the actor channel (a Unix socket beside Ray's calls)
     ├── WireError            a frame that does not decode: magic, sizes, JSON or field types
     ├── ChannelClosed        the connection to the actor is gone
     └── ChannelCallFailed    the actor's `run` raised; the message is its reason
"""

from __future__ import annotations

__all__ = [
    "ActorDied",
    "ActorGone",
    "ChannelCallFailed",
    "ChannelClosed",
    "ChannelError",
    "WireError",
]


class ActorDied(Exception):
    """A call found its actor dead (Ray's RayActorError, or the fake pool's kill)."""

    def __init__(self, actor: str) -> None:
        super().__init__(f"actor {actor} died")
        self.actor = actor


class ActorGone(ActorDied):
    """The actor is dead and its runtime says it will not be restarted (Ray's ActorDiedError
    after the actor's restarts are spent; a restarting one is unavailable)."""


class ChannelError(Exception):
    """Base of the actor channel's errors (the pool maps each to `ActorDied` or
    `ActorFailed`)."""


class WireError(ChannelError):
    """A frame that does not decode: wrong magic, sizes, JSON or field types."""


class ChannelClosed(ChannelError):
    """The connection to the actor is gone (the actor died, or a frame did not decode)."""


class ChannelCallFailed(ChannelError):
    """The actor's `run` raised; the message is its reason."""
