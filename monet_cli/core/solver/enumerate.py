"""Every schedule the runtime can execute, for profiles small enough to enumerate.

The reference the solver is tested and benchmarked against: non-nested segments, and any
subset of each segment's keep candidates.
"""

from __future__ import annotations

import itertools

from monet_cli.core.segments import SegmentModel
from monet_cli.core.simulate import Plan


def all_plans(model: SegmentModel) -> list[Plan]:
    segments = sorted(model.segments)
    families: list[list[int]] = [[]]
    for call in segments:
        families += [f + [call] for f in families if all(not model.overlaps(call, o) for o in f)]
    plans = []
    for family in families:
        keep_choices = [
            [frozenset(c) for r in range(len(model.segments[s].candidates) + 1)
             for c in itertools.combinations(model.segments[s].candidates, r)]
            for s in family
        ]
        for kept in itertools.product(*keep_choices):
            plans.append(dict(zip(family, kept)))
    return plans
