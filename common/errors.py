"""The refusals a spec or a request can meet before any state is involved:
raised by the planner (planning/) and the server's domain, mapped to gRPC
status codes in one table at the server's edge (server/rpc/codec.py).
Messages name the offending value."""


class Refusal(Exception):
    """Base class of every answer the server's domain gives a caller that acts on it."""


class BadRequest(Refusal):
    """A request field (or a spec's) is empty, too long, malformed or out of range."""


class Conflict(Refusal):
    """The request disagrees with what the job already holds (its spec, a node's
    rank, the address family of its members), or the job cannot form."""
