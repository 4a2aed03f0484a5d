"""The pure multi-agent scheduling policy: throughput first, age-scored, pause/resume decisions (no Ray)."""

from decapybara.scheduler.policy import AgePolicy, Decision, PolicyStats
from decapybara.scheduler.scoring import (
    PolicyConfig,
    candidate_score,
    victim_score,
    wait_bound_s,
    work_estimate,
)

__all__ = ["AgePolicy", "Decision", "PolicyConfig", "PolicyStats", "candidate_score", "victim_score",
           "wait_bound_s", "work_estimate"]
