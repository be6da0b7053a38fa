"""Schedules built straight from a plan, as the solver would write them, for tests that run a
chosen plan rather than a solved one."""

from __future__ import annotations

from monet_cli.core.plan import build_schedule
from monet_cli.core.profile import Profile
from monet_cli.core.schedule import Schedule, SolverInfo
from monet_cli.core.segments import SegmentModel
from monet_cli.core.simulate import Plan, Variants

INFO = SolverInfo.not_solved("test")


def plan_schedule(
    profile: Profile,
    plan: Plan,
    *,
    peaks: int = 2,
    model: SegmentModel | None = None,
    variants: Variants = frozenset(),
) -> Schedule:
    """``plan`` as a schedule whose budget is ``peaks`` times the baseline peak: at 2 the plan
    holds it whatever it is, at 1 it must not raise the peak."""
    return build_schedule(
        profile,
        plan,
        budget_bytes=profile.baseline.peak_bytes * peaks,
        budget_spec=f"{peaks}x",
        solver=INFO,
        profile_sha256="",
        model=model,
        variants=variants,
    )
