"""The policy as the scheduler actor runs it: decisions from an `EngineView`, not from the engine itself.

`ViewPolicy.decide(view) -> Control | None` turns a report's view into admit / pause / resume decisions and a
victim order for memory pressure. It never blocks and keeps no reference to engine objects, so the same
policy runs in the SchedulerActor (control plane) while the GPU actor steps (data plane).
"""

from __future__ import annotations

from typing import Any, Protocol

from decapybara.engine.driver import Control, EngineView


class ViewPolicy(Protocol):
    def decide(self, view: EngineView) -> Control | None: ...

    def snapshot(self) -> dict[str, Any]: ...


class FcfsViewPolicy:
    """Baseline: resume paused sequences (oldest first), then admit waiting ones in arrival order."""

    def __init__(self) -> None:
        self.decisions = 0

    def decide(self, view: EngineView) -> Control | None:
        room = view.free_slots
        if room <= 0:
            return None
        paused = sorted((s for s in view.seqs if s.status == "paused"), key=lambda s: s.arrival)
        waiting = sorted((s for s in view.seqs if s.status == "waiting"), key=lambda s: s.arrival)
        resume = [s.request_id for s in paused[:room]]
        admit = [s.request_id for s in waiting[:max(0, room - len(resume))]]
        if not resume and not admit:
            return None
        self.decisions += 1
        return Control(admit=admit, resume=resume)

    def snapshot(self) -> dict[str, Any]:
        return {"policy": "fcfs", "decisions": self.decisions}


def make_policy(cfg: Any) -> ViewPolicy:
    """The policy the app config asks for."""
    return FcfsViewPolicy()
