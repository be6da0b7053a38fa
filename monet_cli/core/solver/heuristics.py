"""Fast schedules: warm starts for CP-SAT and baselines to compare against.

- ``level_plans``: checkpoint every segment at one depth of the module tree (depth 2 in
  a ResNet is every stage, depth 3 every block): what people do by hand.
- ``greedy_keeps``: starting from a plan, keep the op outputs that save the most
  recompute time per byte while the budget still holds.
"""

from __future__ import annotations

import numpy as np

from monet_cli.core.segments import SegmentModel
from monet_cli.core.simulate import Plan, simulate
from monet_cli.core.solver.linear import LinearMemory


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
