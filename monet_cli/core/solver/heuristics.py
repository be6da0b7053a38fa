"""Fast schedules: warm starts for CP-SAT and baselines to compare against.

- ``level_plans``: checkpoint every segment at one depth of the module tree (depth 2 in
  a ResNet is every stage, depth 3 every block): what people do by hand.
- ``greedy_keeps``: starting from a plan, keep the op outputs that save the most
  recompute time per byte while the budget still holds.
- ``lower_peak``: starting from a plan over budget, add segments where the step's memory is
  highest until it fits: where no level plan fits, a plan to start from in a fraction of a
  second, so a short time limit still finds one.
"""

from __future__ import annotations

import time

import numpy as np

from monet_cli.core.segments import SegmentModel
from monet_cli.core.simulate import Plan, SimResult, nesting_problem, simulate
from monet_cli.core.solver.linear import LinearMemory

TRIALS_PER_ROUND = 8
"""Segments ``lower_peak`` simulates a round: those its linear rows say lower the highest point
most per ms. Simulating every one that lowers it found the same plans on resnet50 (batch 32,
128 px) at 50% and 45% of its peak, in 2.1 s instead of 0.4 s (12-07)."""
MIN_MS = 1e-3
"""The least time a segment is taken to add when dividing by it."""


def level_plans(model: SegmentModel) -> dict[str, Plan]:
    depths: dict[int, list[int]] = {}
    for c in model.segments:
        if c in model.ranges:
            continue  # ranges of one module cross each other: not a level of the tree
        # The ranges enclosing a call are not levels either: counted, every block of a
        # ResNet stage would sit at another depth.
        depth = sum(1 for a in model.ancestors[c] if a not in model.ranges)
        depths.setdefault(depth, []).append(c)
    return {f"depth-{d}": {c: frozenset() for c in calls} for d, calls in sorted(depths.items())}


def greedy_keeps(linear: LinearMemory, plan: Plan, budget_bytes: int) -> Plan:
    """Add keeps one by one (best time saved per byte first) while the plan fits.

    Each trial is read off the linear memory model (one vector addition); the result is
    then simulated, and while the simulator finds it over budget (segments interacting in
    ways the linear model does not see) the last keeps are taken back.
    """
    model = linear.model
    ops, storages = model.profile.ops, model.profile.storages
    candidates = []
    for c in plan:
        for i in model.segments[c].candidates:
            if i not in plan[c]:
                nbytes = sum(storages[s].bytes for s in model.outputs_by_op.get(i, [])) or 1
                candidates.append((ops[i].time_ms / nbytes, c, i))
    candidates.sort(key=lambda item: (-item[0], item[1], item[2]))
    active = linear.active_mask(plan)
    live = np.where(active, linear.predict(plan), 0)
    added: list[tuple[int, int]] = []
    for _, c, i in candidates:
        trial = live + np.where(active, linear.keep_delta[(c, i)].dense(len(live)), 0)
        if trial.max() <= budget_bytes:
            live = trial
            added.append((c, i))
    current = {c: set(kept) for c, kept in plan.items()}
    for c, i in added:
        current[c].add(i)
    while added and simulate(model.profile, _frozen(current), model=model).peak_bytes > budget_bytes:
        c, i = added.pop()
        current[c].discard(i)
    return _frozen(current)


def _frozen(plan: dict[int, set[int]]) -> Plan:
    return {c: frozenset(kept) for c, kept in plan.items()}


def best_heuristic(linear: LinearMemory, budget_bytes: int) -> tuple[str, Plan, bool]:
    """The fastest level plan that fits (then greedy keeps), else the lowest-peak one.

    Returns (name, plan, fits).
    """
    model = linear.model
    scored = []
    for name, plan in {"none": {}, **level_plans(model)}.items():
        result = simulate(model.profile, plan, model=model)
        scored.append((result.peak_bytes <= budget_bytes, result.step_ms, result.peak_bytes, name, plan))
    fitting = [s for s in scored if s[0]]
    if fitting:
        _, _, _, name, plan = min(fitting, key=lambda s: (s[1], s[2], s[3]))
        return f"{name}+greedy-keeps", greedy_keeps(linear, plan, budget_bytes), True
    _, _, _, name, plan = min(scored, key=lambda s: (s[2], s[1], s[3]))
    return name, plan, False


def lower_peak(linear: LinearMemory, plan: Plan, budget_bytes: int, *, deadline: float) -> tuple[Plan, SimResult]:
    """``plan`` with segments added until the simulator puts it within ``budget_bytes``, no
    segment lowers it, or ``time.perf_counter()`` passes ``deadline``; with its simulation.

    Each round takes the step's highest point and, of the segments whose rows lower it (alone,
    or nested in a chosen segment), simulates the ``TRIALS_PER_ROUND`` that lower it most per
    ms. It adds the one that lowers the peak most per ms added, without raising it; the point
    itself breaks ties, as several points can share the peak. Where none can be added beside
    the chosen segments, one replaces those it overlaps if that lowers the peak.

    It stops short of the smallest peak: from no segments, on the shipped profiles (12-07), at
    498 MiB for resnet50's 469 (its highest point then lies in a recompute already nested three
    deep), 37.7 MiB for unet's 35.6 and 27.0 MiB for tiny_gpt's 24.2. Closer than that the
    solver searches the smallest peak itself (``Planner.minimum_peak``).
    """
    model = linear.model
    result = simulate(model.profile, plan, model=model)
    while result.peak_bytes > budget_bytes and time.perf_counter() < deadline:
        lowering = _lowering_at_peak(linear, plan)
        step = _best_trial(model, plan, result, lowering, replacing=False) or _best_trial(
            model, plan, result, lowering, replacing=True
        )
        if step is None:
            break
        plan, result = step
    return plan, result


def _lowering_at_peak(linear: LinearMemory, plan: Plan) -> list[tuple[int, int]]:
    """(segment, the bytes its rows add at the highest point of ``plan``'s step) for each segment
    not in ``plan`` that lowers that point, most lowering per ms first."""
    model = linear.model
    live = np.where(linear.active_mask(plan), linear.live(plan), 0)
    segments, _, nested, _, _ = linear.coefficients_at(int(np.argmax(live)))
    change = dict(segments)
    for (outer, inner), nbytes in nested.items():
        if outer in plan:
            change[inner] = change.get(inner, 0) + nbytes
    lowering = [(c, nbytes) for c, nbytes in change.items() if nbytes < 0 and c not in plan]
    return sorted(lowering, key=lambda item: (item[1] / max(model.added_ms(item[0]), MIN_MS), item[0]))


def _best_trial(
    model: SegmentModel, plan: Plan, result: SimResult, lowering: list[tuple[int, int]], *, replacing: bool
) -> tuple[Plan, SimResult] | None:
    """The best of the first ``TRIALS_PER_ROUND`` segments of ``lowering`` that can be added to
    ``plan`` (``replacing``: that can only replace the chosen segments they overlap), simulated.
    Adding must not raise the peak and replacing must lower it, so ``lower_peak`` ends."""
    best = None
    trials = 0
    for c, nbytes in lowering:
        if trials == TRIALS_PER_ROUND:
            break
        trial = _replacing(model, plan, c) if replacing else _adding(model, plan, c)
        if trial is None:
            continue
        trials += 1
        trial_result = simulate(model.profile, trial, model=model)
        lowered = result.peak_bytes - trial_result.peak_bytes
        if lowered < 0 or (replacing and lowered == 0):
            continue
        ms = max(trial_result.step_ms - result.step_ms, MIN_MS)
        score = (lowered / ms, -nbytes / ms)
        if best is None or score > best[0]:
            best = (score, trial, trial_result)
    return None if best is None else best[1:]


def _adding(model: SegmentModel, plan: Plan, c: int) -> Plan | None:
    trial = {**plan, c: frozenset()}
    return None if nesting_problem(model, trial) else trial


def _replacing(model: SegmentModel, plan: Plan, c: int) -> Plan | None:
    """``plan`` with segment ``c`` in place of the chosen segments it overlaps, where ``c``
    cannot be added beside them."""
    if _adding(model, plan, c) is not None:
        return None
    new = model.segments[c]
    trial = {
        kept: ops
        for kept, ops in plan.items()
        if model.segments[kept].end_op <= new.first_op or new.end_op <= model.segments[kept].first_op
    }
    trial[c] = frozenset()
    return None if nesting_problem(model, trial) else trial
