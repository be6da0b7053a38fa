"""Turn a plan (chosen segments and kept ops) into a schedule, scored by the simulator."""

from __future__ import annotations

import datetime as _dt
from collections.abc import Callable
from typing import Any

from monet_cli.core.offload import site_plan, with_offload_sites
from monet_cli.core.profile import Profile, VariantRecord
from monet_cli.core.ranges import OpRange
from monet_cli.core.schedule import (
    EXECUTOR,
    SCHEDULE_KIND,
    SCHEMA_VERSION,
    Decision,
    KeepDecision,
    OffloadDecision,
    Predicted,
    Schedule,
    SegmentDecision,
    SolverInfo,
    VariantDecision,
    with_content_hash,
)
from monet_cli.core.segments import SegmentModel
from monet_cli.core.simulate import Plan, SimResult, Variants, simulate
from monet_cli.core.solver.search import Hint, Planner, SolveOutcome, solver_info
from monet_cli.core.variants import TOLERANCE
from monet_cli.errors import UsageError


def decisions_of(model: SegmentModel, plan: Plan, variants: Variants = frozenset()) -> tuple[Decision, ...]:
    """The plan as schedule decisions, in forward order: each segment, then the ops it keeps;
    then the operator variants, in forward order. The first segment's overhead carries what
    the step pays once for checkpointing anything (``Overheads.first_frame_ms``)."""
    ops = model.profile.ops
    frames = model.frames(plan)
    decisions: list[Decision] = []
    once_ms = model.profile.overheads.first_frame_ms
    for n, call in enumerate(sorted(plan, key=lambda c: (model.segments[c].first_op, -model.segments[c].end_op))):
        seg = model.segments[call]
        decisions.append(
            SegmentDecision(
                module=seg.fqn,
                chain=seg.members,
                call=call,
                first_op=seg.first_op,
                end_op=seg.end_op,
                recompute_ms=round(model.recompute_ms(call, plan[call], frames[call]), 4),
                overhead_ms=round(model.overhead_ms(call, plan[call], frames[call]) + (once_ms if n == 0 else 0.0), 4),
                **(_range_fields(model.profile, seg.range) if seg.range else {}),
            )
        )
        decisions += [
            KeepDecision(segment=seg.fqn, index=i, op=ops[i].op, occurrence=model.occurrence(call, i))
            for i in sorted(plan[call])
        ]
    for index in sorted(variants):
        record = model.profile.variants[index]
        if record.impl == "offload":
            decisions.append(_offload_decision(model.profile, record))
            continue
        rtol, atol = TOLERANCE[record.impl]
        decisions.append(VariantDecision(**record.site(), time_ms=record.time_ms, rtol=rtol, atol=atol))
    return tuple(decisions)


def _range_fields(profile: Profile, r: OpRange) -> dict[str, Any]:
    """What the runtime needs to find an op range: its module, its calls and where it opens and closes."""
    return {
        "within": profile.calls[r.parent].fqn,
        "calls": tuple(profile.calls[c].fqn for c in r.calls),
        "opens_at_call": r.opens_at_call,
        "closes_at_call": r.closes_at_call,
        "skip": r.skip,
        "own_ops": r.own_ops,
    }


def _offload_decision(profile: Profile, record: VariantRecord) -> OffloadDecision:
    plan = site_plan(profile, record)
    call = plan.call
    return OffloadDecision(
        module=call.fqn,
        call=call.index,
        first_op=call.first_op,
        end_op=call.end_op,
        packs=plan.ordinals(profile),
        fetch_order=plan.fetch_order(profile),
        saves=len(plan.packs),
        bytes=record.native_saved_bytes,
        time_ms=record.time_ms,
    )


def plan_of(schedule: Schedule, model: SegmentModel) -> Plan:
    """The schedule's segments and what they keep, as ``model``'s call indices. A schedule names
    each segment by its call index among the segments its profile offered; a profile that
    offers others (made by another monet) would map them to other segments."""
    for s in schedule.segments:
        if s.call not in model.segments or model.segments[s.call].fqn != s.module:
            raise UsageError(
                f"the profile offers no segment '{s.module}' where the schedule has it (a profile made "
                "by another version of monet? pass the schedule's own profile, or profile again)"
            )
    return schedule.kept()


def variants_of(schedule: Schedule, profile: Profile) -> Variants:
    """The schedule's variants and offloads as indices into the variants of ``SegmentModel(profile).profile``
    (matched by kind and ops)."""
    offered = with_offload_sites(profile).variants
    index_of = {(record.impl, record.ops): i for i, record in enumerate(offered)}
    wanted = [(v.module, (v.impl, v.ops)) for v in schedule.variants]
    wanted += [(o.module, ("offload", tuple(range(o.first_op, o.end_op)))) for o in schedule.offloads]
    missing = [module for module, key in wanted if key not in index_of]
    if missing:
        raise UsageError(
            f"the profile offers no operator variant or offload at '{missing[0]}', which the schedule "
            "runs (a profile made before monet measured them? pass the schedule's own profile)"
        )
    return frozenset(index_of[key] for _, key in wanted)


def predicted(profile: Profile, result: SimResult) -> Predicted:
    base = profile.baseline
    reference = base.reference_step_ms
    return Predicted(
        peak_bytes=result.peak_bytes,
        step_ms=round(result.step_ms, 4),
        overhead=round(result.step_ms / reference - 1.0, 6) if reference > 0 else 0.0,
        baseline_peak_bytes=base.peak_bytes,
        baseline_step_ms=reference,
        preparation_ms=round(base.step_ms - reference, 4),
        checks_ms=round(result.checks_ms, 4),
        peak_pos=result.peak_pos,
        alloc_conf=profile.device.alloc_conf,
    )


def predicted_for(schedule: Schedule, profile: Profile, model: SegmentModel | None = None) -> Predicted:
    """What ``profile``'s prices predict for ``schedule``'s decisions: the schedule's own
    prediction from its own profile, or the one at another speed from that profile timed again
    (``monet_cli/profiler/window.py``). ``model``: ``SegmentModel(profile)`` where the caller
    already built it for several schedules."""
    if model is None:
        model = SegmentModel(profile)
    result = simulate(model.profile, plan_of(schedule, model), model=model, variants=variants_of(schedule, profile))
    return predicted(model.profile, result)


def build_schedule(
    profile: Profile,
    plan: Plan,
    *,
    budget_bytes: int,
    budget_spec: str,
    solver: SolverInfo,
    profile_sha256: str,
    model: SegmentModel | None = None,
    created_at: str | None = None,
    variants: Variants = frozenset(),
) -> Schedule:
    if model is None:
        model = SegmentModel(profile)
    result = simulate(profile, plan, model=model, variants=variants)
    return with_content_hash(
        Schedule(
            schema_version=SCHEMA_VERSION,
            kind=SCHEDULE_KIND,
            budget_bytes=budget_bytes,
            budget_spec=budget_spec,
            model=profile.model,
            fingerprint=profile.fingerprint,
            profile_sha256=profile_sha256,
            predicted=predicted(profile, result),
            solver=solver,
            env=profile.env,
            executor=EXECUTOR,
            created_at=created_at if created_at is not None else _now(),
            content_sha256="",
            decisions=decisions_of(model, plan, variants),
        )
    )


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def solve_schedule(
    planner: Planner,
    budget_bytes: int,
    budget_spec: str,
    *,
    time_limit_s: float,
    workers: int,
    seed: int,
    relative_gap: float = 0.0,
    hint: Hint | None = None,
    profile_sha256: str = "",
    report: Callable[[str], None] = lambda message: None,
) -> tuple[Schedule | None, SolveOutcome]:
    """Profile + budget -> schedule, the one way: solve, then score the plan with the simulator
    (None when the solver found no plan). Solve, the sweep, the benchmarks and gpu-check all
    come through here."""
    outcome = planner.solve(
        budget_bytes,
        time_limit_s=time_limit_s,
        workers=workers,
        seed=seed,
        relative_gap=relative_gap,
        hint=hint,
        report=report,
    )
    if outcome.plan is None:
        return None, outcome
    schedule = build_schedule(
        planner.model.profile,
        outcome.plan,
        budget_bytes=budget_bytes,
        budget_spec=budget_spec,
        model=planner.model,
        profile_sha256=profile_sha256,
        variants=outcome.variants,
        solver=solver_info(outcome, workers=workers, seed=seed, time_limit_s=time_limit_s, relative_gap=relative_gap),
    )
    if schedule.predicted.peak_bytes > budget_bytes:  # the simulator is the judge; never return a plan over budget
        raise AssertionError("internal error: solver returned a plan the simulator puts over budget")
    return schedule, outcome
