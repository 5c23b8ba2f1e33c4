"""The lessor: members' leases and the heap of their deadlines, as etcd's
lessor keeps them. It is told when a lease is granted, renewed, bound to a
Join call or detached from its session, and returns the members whose lease
ran out; what their loss does is the deciders' (leaving.py).

A member's lease is in one of the named states of model.Lease, with a
deadline (`Deadline | None`: None while its Join call binds it). The heap's
entries are lazy (deadlines.py): a renewal pushes nothing, and a member's
entry is pushed only when its deadline comes before its live entry's (leaving
a stretched first lease, a reconnect grace)."""

from __future__ import annotations

from collections.abc import Callable

from .deadlines import Deadline, Deadlines
from .model import Lease, Member


class Lessor:
    """Every member's lease. Its state: the TTL and reconnect grace, the
    clock, the deadline heap, and the widest world granted first leases
    here; it alone writes a member's `lease`, `lease_deadline` and `queued`.

    `holder(job id, member id)` finds a member (None: gone): the lessor keys
    its entries by ids and never holds a member itself.
    """

    # A newly seated member's first lease also covers the time the server takes
    # to open the sessions of its whole world (about a millisecond each in
    # grpc.aio, benchmarks/reform_scale.py): a member must not lose its seat to
    # the server's own backlog.
    SESSION_OPEN_S = 0.001

    def __init__(self, ttl_s: float, grace_s: float, clock: Callable[[], float],
                 holder: Callable[[str, str], Member | None]) -> None:
        self.ttl_s = ttl_s
        self.grace_s = grace_s  # a session that ended without a Leave keeps its seat this long
        self._clock = clock
        self._holder = holder
        self._heap = Deadlines()  # (job id, member id)
        self.widest_world = 0  # the most workers of a world formed here: its first leases are the longest
        self._deaf_until: Deadline | None = None  # after a stall: no lease ends before it (None: none)

    def __len__(self) -> int:
        """Entries in the heap, stale ones included."""
        return len(self._heap)

    def naming_wait_s(self, open_streams: int) -> float:
        """How long a new session stream may take to name its member: the lease
        TTL, stretched as a world's first lease is by the time the server takes
        to open that many streams (a whole world's sessions open at once), and
        never shorter than the longest first lease granted here (the widest
        world's): a stream is not closed while the member it would name still
        holds its seat."""
        return self.ttl_s + max(open_streams, self.widest_world) * self.SESSION_OPEN_S

    def first_lease(self, now: float, world_size: int) -> Deadline:
        """The deadline of the first leases of a world of `world_size` forming `now`."""
        self.widest_world = max(self.widest_world, world_size)
        return now + self.ttl_s + world_size * self.SESSION_OPEN_S

    def grant(self, job_id: str, member_id: str, member: Member, deadline: Deadline) -> None:
        """A first lease (FIRST), until `deadline`: a member seated, or restored."""
        member.lease, member.lease_deadline = Lease.FIRST, deadline
        self._queue(job_id, member_id, member, deadline)

    @staticmethod
    def bind(member: Member) -> None:
        """The member is bound to a Join call again (IN_JOIN): no deadline."""
        member.lease, member.lease_deadline = Lease.IN_JOIN, None

    def answered(self, member: Member) -> None:
        """A first lease runs at least a TTL from now (its member's Join is answered now); the
        heap entry is lazy: it finds the later deadline when it comes due."""
        if member.lease is Lease.FIRST:
            member.lease_deadline = max(member.lease_deadline, self._clock() + self.ttl_s)

    def release(self, job_id: str, member_id: str, member: Member) -> None:
        """The Join call that held a seated member ended before its next world: one TTL from now."""
        self.grant(job_id, member_id, member, self._clock() + self.ttl_s)

    def renew(self, job_id: str, member_id: str, member: Member, attach: bool) -> None:
        """The member was heard from. `attach`: its message may take a DETACHED
        lease back (it names no generation older than the member's).
        IN_JOIN is bound to its Join call; DETACHED and not `attach`, a stale
        process: its grace runs on."""
        if member.lease is Lease.DETACHED and attach:
            member.lease = Lease.RENEWING  # heard from within the grace (a KeepAlive, or a session reattaching)
        if member.lease is Lease.RENEWING:  # the common case: the heap entry is lazy, nothing is pushed
            member.lease_deadline = self._clock() + self.ttl_s
        elif member.lease is Lease.FIRST:
            # Leaving a first lease, which may be stretched far past TTL: the one
            # push this costs makes last renewal + TTL the bound from now on.
            member.lease, member.lease_deadline = Lease.RENEWING, self._clock() + self.ttl_s
            self._queue(job_id, member_id, member, member.lease_deadline)

    def detach(self, job_id: str, member_id: str, member: Member) -> None:
        """The member's session ended without a Leave: it keeps its seat for the reconnect grace (DETACHED)."""
        member.lease = Lease.DETACHED
        member.lease_deadline = min(member.lease_deadline, self._clock() + self.grace_s)
        self._queue(job_id, member_id, member, member.lease_deadline)

    def lately(self, member: Member, now: float) -> bool:
        """Whether the member renewed within the last half TTL (clients renew every third): it is alive."""
        return member.lease_deadline is None or member.lease_deadline >= now + self.ttl_s / 2

    def age(self, member: Member, now: float) -> float | None:
        """How long ago a RENEWING member last renewed (None: any other lease)."""
        return now - (member.lease_deadline - self.ttl_s) if member.lease is Lease.RENEWING else None

    def deaf(self, now: float, for_s: float) -> None:
        """The server heard nothing for `for_s` seconds up to `now` (its event loop
        stalled: a long GC, a starved or paused process): no lease ends before
        `now` + that time (at most a TTL), so that the renewals that waited in
        its sockets meanwhile are heard first. A member is only lost for a
        silence the server could have heard, as etcd's lessor extends every
        lease when a new leader takes over."""
        until = now + min(for_s, self.ttl_s)
        self._deaf_until = until if self._deaf_until is None else max(self._deaf_until, until)

    def next(self) -> Deadline | None:
        """The earliest deadline in the heap (it may be stale), or the end of
        a deafness (deaf) before which none comes due; None: no lease runs."""
        top = self._heap.next()
        if top is None or self._deaf_until is None:
            return top
        return max(top, self._deaf_until)

    def expired(self, now: float, limit: int) -> list[tuple[str, str, Lease]]:
        """The members whose lease ran out by `now`: (job id, member id, the
        lease that ran out), at most `limit`, looking at most `2 * limit`
        entries, so that an expiry storm (or ten thousand leases of one world
        coming up for their lazy check at once) yields the event loop between
        calls. Renewed members' entries are pushed again."""
        out: list[tuple[str, str, Lease]] = []
        if self._deaf_until is not None:
            if now < self._deaf_until:
                return out
            self._deaf_until = None
        popped = 0
        while len(out) < limit and popped < 2 * limit:
            entry = self._heap.pop_due(now)
            if entry is None:
                break
            popped += 1
            job_id, member_id = entry[1]
            member = self._holder(job_id, member_id)
            if member is None or entry[0] != member.queued:
                continue  # gone, or a stale entry (its live one is earlier or later)
            member.queued = None
            if member.lease is Lease.IN_JOIN:
                continue  # bound to a Join call again
            if member.lease_deadline > now:
                self._queue(job_id, member_id, member, member.lease_deadline)  # renewed since: wait for the new deadline
                continue
            out.append((job_id, member_id, member.lease))
        return out

    def oldest(self) -> Deadline | None:
        """The earliest lease deadline (None: no lease runs), bringing stale heap entries up to date on the way."""
        while (top := self._heap.next()) is not None:
            entry = self._heap.pop_due(top)
            job_id, member_id = entry[1]
            member = self._holder(job_id, member_id)
            if member is None or entry[0] != member.queued:
                continue
            member.queued = None
            if member.lease is Lease.IN_JOIN:
                continue
            self._queue(job_id, member_id, member, member.lease_deadline)
            if member.lease_deadline == top:
                return top
        return None

    def _queue(self, job_id: str, member_id: str, member: Member, deadline: Deadline) -> None:
        """Makes sure the heap holds an entry for the member due by `deadline`:
        pushed only when its live entry is due later (a stretched first lease,
        a grace shorter than the lease), so a renewal costs no push."""
        if member.queued is None or deadline < member.queued:
            member.queued = deadline
            self._heap.push(deadline, (job_id, member_id))
