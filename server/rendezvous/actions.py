"""What a transition of the state machine implies, for the executor to carry out."""

from __future__ import annotations

from .model import JobEvent, Note, PlanRequest, SessionEvent, WaitOutcome
from .store import Write

SLICE = 50  # pushes or wakes between two yields of the event loop: each wakes a coroutine that runs in the next turn


class Actions:
    """What a transition implies, for the executor to carry out in this order:
    persist `writes`, hand `notes` to telemetry, put `pushes` in session sinks,
    wake Join waiters with `wakes`, and plan `plans` off the event loop."""

    __slots__ = ("writes", "notes", "pushes", "wakes", "plans", "events")

    def __init__(self) -> None:
        self.writes: list[Write] = []
        self.notes: list[Note] = []
        self.pushes: list[tuple[object, SessionEvent]] = []  # (session sink, event)
        self.wakes: list[tuple[str, WaitOutcome]] = []  # (job id, outcome)
        self.plans: list[PlanRequest] = []
        self.events: list[tuple[str, JobEvent]] = []  # (job id, event) for those watching its history

    def __bool__(self) -> bool:
        return bool(self.writes or self.notes or self.pushes or self.wakes or self.plans or self.events)

    def extend(self, other: Actions) -> None:
        for name in self.__slots__:
            getattr(self, name).extend(getattr(other, name))

    def __repr__(self) -> str:
        return (f"Actions(writes={self.writes!r}, notes={self.notes!r}, pushes={self.pushes!r}, wakes={self.wakes!r}, "
                f"plans={self.plans!r}, events={self.events!r})")
