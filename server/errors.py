"""The errors the rendezvous domain reports to callers.

Each class stands for one answer a caller can act on; the servicer maps them to
gRPC status codes in a single table. Messages name the offending values.
"""


class RendezvousError(Exception):
    """Base class of every error reported to a caller."""


class InvalidArgument(RendezvousError):
    """A request field is empty, too long, malformed or out of range."""


class Conflict(RendezvousError):
    """The request disagrees with what the job already holds (its spec, a node's
    rank, the address family of its members), or the job cannot form."""


class Closed(Conflict):
    """The job was closed (a launcher shut the run down): it takes no more joins."""


class StaleGeneration(RendezvousError):
    """The caller names a generation other than the job's current one."""


class AlreadyExists(RendezvousError):
    """A local rank or node rank that another worker already holds."""


class JobFull(RendezvousError):
    """The job already has all the workers its world needs."""


class NotFound(RendezvousError):
    """Unknown job or member (never joined, left, or its lease expired)."""


class WaitTimeout(RendezvousError):
    """The world did not form within the caller's wait timeout."""


class Unavailable(RendezvousError):
    """The server is shutting down and accepts no new work."""


class NotLeader(Unavailable):
    """This replica does not serve the rendezvous now (HA): `leader` is the
    address of the one that does, if known."""

    def __init__(self, message: str, leader: str = "") -> None:
        super().__init__(message)
        self.leader = leader


class SessionReplaced(RendezvousError):
    """The member opened a newer session; this one ends (its end is no departure)."""


class LimitExceeded(RendezvousError):
    """The server holds as much as one of its limits allows; the message names the limit."""


class PermissionDenied(RendezvousError):
    """The job is sealed and the call's job secret is missing or wrong."""


class Unauthenticated(RendezvousError):
    """The call carries no token, or one the server does not know."""
