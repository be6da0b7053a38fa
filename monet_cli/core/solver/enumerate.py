"""Every schedule the runtime can execute, for profiles small enough to enumerate.

The reference the solver is tested and benchmarked against: segments that do not overlap
or nest (``nesting_problem``), and any subset of each segment's keep candidates (nested segments keep
nothing).
"""

from __future__ import annotations

import itertools

from monet_cli.core.segments import SegmentModel
from monet_cli.core.simulate import Plan, nesting_problem
from monet_cli.core.solver.linear import nest_paths


def all_plans(model: SegmentModel) -> list[Plan]:
    families: list[list[int]] = [[]]
    for call in sorted(model.segments):
        families += [f + [call] for f in families if not nesting_problem(model, dict.fromkeys(f + [call], frozenset()))]
    plans = []
    for family in families:
        nested = {c for path in nest_paths(model, dict.fromkeys(family, frozenset())) for c in path}
        keep_choices = [
            [frozenset()]
            if s in nested
            else [
                frozenset(c)
                for r in range(len(model.segments[s].candidates) + 1)
                for c in itertools.combinations(model.segments[s].candidates, r)
            ]
            for s in family
        ]
        for kept in itertools.product(*keep_choices):
            plans.append(dict(zip(family, kept)))
    return plans
