"""The refusals the rendezvous domain gives callers, beyond those the planner
shares (commctx.common.errors: Refusal, BadRequest, Conflict).

Each class stands for one answer a caller can act on; the gRPC edge
(rpc/status.py) maps them to status codes in a single table. Messages name
the offending values. (The client's public errors, commctx.errors, are named
otherwise: they are what users catch.)
"""

from commctx.common.errors import BadRequest, Conflict, Refusal

__all__ = ["AlreadyExists", "BadRequest", "Closed", "Conflict", "Full", "LimitExceeded", "NotFound", "NotLeader",
           "Refusal", "Sealed", "SessionReplaced", "Stale", "Unavailable", "UnknownToken", "WaitTimeout"]


class Closed(Conflict):
    """The job was closed (a launcher shut the run down): it takes no more joins."""


class Stale(Refusal):
    """The caller names a generation other than the job's current one."""


class AlreadyExists(Refusal):
    """A local rank or node rank that another worker already holds."""


class Full(Refusal):
    """The job already has all the workers its world needs."""


class NotFound(Refusal):
    """Unknown job or member (never joined, left, or its lease expired)."""


class WaitTimeout(Refusal):
    """The world did not form within the caller's wait timeout."""


class Unavailable(Refusal):
    """The server is shutting down and accepts no new work."""


class NotLeader(Unavailable):
    """This replica does not serve the rendezvous now (HA): `leader` is the
    address of the one that does, if known."""

    def __init__(self, message: str, leader: str = "") -> None:
        super().__init__(message)
        self.leader = leader


class SessionReplaced(Refusal):
    """The member opened a newer session; this one ends (its end is no departure)."""


class LimitExceeded(Refusal):
    """The server holds as much as one of its limits allows; the message names the limit."""


class Sealed(Refusal):
    """The job is sealed and the call's job secret is missing or wrong."""


class UnknownToken(Refusal):
    """The call carries no token, or one the server does not know."""
