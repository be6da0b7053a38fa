"""Descent on a plan that nothing proved: drop the segments and operator variants the budget
does not need.

Where CP-SAT proves nothing, the solve returns its fastest fitting start, and near the
smallest peak that start is the smallest peak's own plan: minimising the peak alone, CP-SAT
checkpoints whatever does not raise the peak, needed or not. On mobilenet_v2 (batch 32,
128 px, 12-07) the smallest peak's plan held 21 segments and 2 variants at +52.6% predicted;
dropping what the simulator said was not needed left 15 and 1 at +42.1%, in 0.3 s. Run
interleaved on a fresh profile, such a descended plan was 6.2% faster a step (90% interval
4.9 to 6.9%), at the same measured peak.
"""

from __future__ import annotations

import time

from monet_cli.core.segments import SegmentModel
from monet_cli.core.simulate import Plan, SimResult, Variants, nesting_problem, simulate


def descend(
    model: SegmentModel, start: tuple[Plan, Variants, SimResult], budget_bytes: int, *, deadline: float
) -> tuple[Plan, Variants, SimResult]:
    """The plan and variants of ``start`` (with their simulation) less each segment or variant
    whose removal the simulator finds within ``budget_bytes`` and faster, the costliest tried
    first, in passes until one removes nothing or ``time.perf_counter()`` passes ``deadline``.
    A removal that leaves segments nested in a way they cannot run is skipped."""
    plan, variants, best = start
    improved = True
    while improved and time.perf_counter() < deadline:
        improved = False
        for segment, variant in _removals(model, plan, variants):
            if time.perf_counter() >= deadline:
                break
            trial_plan = {c: kept for c, kept in plan.items() if c != segment}
            if len(trial_plan) < len(plan) and nesting_problem(model, trial_plan):
                continue
            trial_variants = variants - {variant}
            result = simulate(model.profile, trial_plan, model=model, variants=trial_variants)
            if fits_faster(result, budget_bytes, best):
                plan, variants, best, improved = trial_plan, trial_variants, result, True
    return plan, variants, best


def fits_faster(result: SimResult, budget_bytes: int, than: SimResult | None) -> bool:
    """``result`` is within ``budget_bytes`` and a faster step than ``than`` (None: anything)."""
    return result.peak_bytes <= budget_bytes and (than is None or result.step_ms < than.step_ms)


def _removals(model: SegmentModel, plan: Plan, variants: Variants) -> list[tuple[int | None, int | None]]:
    """(segment, None) for each segment of ``plan``, then (None, variant) for each variant,
    costliest first."""
    costs = {c: model.added_ms(c, kept) for c, kept in plan.items()}
    sites = model.profile.variants
    return [(c, None) for c in sorted(costs, key=lambda c: (-costs[c], c))] + [
        (None, v) for v in sorted(variants, key=lambda v: (-sites[v].time_ms, v))
    ]
