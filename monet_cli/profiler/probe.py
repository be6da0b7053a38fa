"""Price an op range on the model's own code: what its tape really costs.

The profile prices an op range's tape on a chain of one-argument ops (``overheads.py``). The
model's own code costs the tape otherwise than tanh does: when the tape held aten ops, views
with size lists, transposes and splits into lists made tiny_gpt's recorder (batch 16, on a
fast spell of this machine) take about 45 us per own op in the forward, where the chain
priced recording and replay together at 2 to 34 us; now that it holds torch calls, an own op
costs what its share of a torch call does (tiny_gpt's block: 41 own ops in 13 torch calls).

So where the profile offers ranges, the module holding the most own ops among their modules
is run alone, on copies, on the inputs it gets in the step, interleaved: its forward alone,
and under plain checkpoint and as one op range over its whole forward, each the forward
alone and forward and backward. The forward against the call's wall time in the profile's
steps says how fast the machine runs now, and the differences are taken in the profile's
time: the range minus checkpoint in each round (both re-run the same ops under the same
frame: the range adds its tape), their median divided by its own ops, is the tape's price per
own op, and the same of the forwards alone its recording's share. A nested range is recorded
again in its outer segment's recompute: priced at a whole record and replay, tiny_gpt's
smallest-peak plan (two blocks, each with a range of 39 own ops nested) ran 5 points faster
than predicted.

What a recompute's code costs beyond its calls' wall times is timed in the step
(``in_step.py``): timed here, on a block alone, it came out higher than in the step.
"""

from __future__ import annotations

import copy
import statistics
import warnings
from dataclasses import dataclass, replace

from monet_cli.core.profile import Overheads, Profile
from monet_cli.core.ranges import calls_made, own_op_count
from monet_cli.core.schedule import SegmentDecision
from monet_cli.core.segments import SegmentModel
from monet_cli.profiler.alone import forward_of, inputs_of, interleaved, step_of
from monet_cli.runtime.meter import MachineryMarker
from monet_cli.runtime.ranges import RangeSegment
from monet_cli.workload.step import Workload

MIN_OWN_OPS = 8
"""Fewer own ops than this leave the generic prices: timing noise would be most of the range's."""
ROUNDS = 21
"""Interleaved runs of each version, after one warm-up run of each."""


@dataclass(frozen=True, kw_only=True, slots=True)
class _Times:
    """Of the module run alone, in ms: the median of its plain forward, and medians of paired
    differences (one a round) of the range over plain checkpoint, forward and backward and the
    forward alone. Pairs rather than a difference of medians: over six runs of 21 rounds on
    tiny_gpt's block (12-06) the pairs gave 14 to 25 us an own op, the medians 18 to 43."""

    forward_ms: float
    range_over_checkpoint_ms: float
    range_forward_over_checkpoint_ms: float


@dataclass(frozen=True, kw_only=True, slots=True)
class _Probe:
    call: int
    """The module's call in the profile (a segment candidate)."""
    range: SegmentDecision
    """One op range over its whole forward."""


def probe_overheads(workload: Workload, profile: Profile) -> Overheads:
    """``profile.overheads`` with the range's price taken on the model's own code, where a
    module qualifies (else unchanged; a warning says why when the module cannot run alone)."""
    model = SegmentModel(profile)
    probe = _probe(model)
    if probe is None:
        return profile.overheads
    try:
        times = _timed(workload, probe.range)
    except Exception as err:  # a module that cannot run alone: the model's own step is not at stake
        warnings.warn(
            f"monet: op ranges keep their generic price: timing '{probe.range.within}' alone failed "
            f"({type(err).__name__}: {err})",
            stacklevel=2,
        )
        return profile.overheads
    wall_ms = profile.calls[probe.call].time_ms
    now = times.forward_ms / wall_ms if wall_ms else 1.0  # this machine's speed now over the profile's steps'

    def per_own_op(ms: float) -> float:
        return round(max(0.0, ms / now / probe.range.own_ops), 6)

    range_op_ms = per_own_op(times.range_over_checkpoint_ms)
    return replace(
        profile.overheads,
        range_op_ms=range_op_ms,
        range_record_op_ms=min(range_op_ms, per_own_op(times.range_forward_over_checkpoint_ms)),
    )


def _probe(model: SegmentModel) -> _Probe | None:
    """Among the segment candidates holding offered ranges (not the model itself: it cannot
    run alone) whose calls are all registered, the one with the most own ops, if it has at least
    ``MIN_OWN_OPS``."""
    profile = model.profile
    children = calls_made(profile)
    best: tuple[int, _Probe] | None = None
    for parent in {r.parent for c, r in model.ranges.items() if c in model.segments}:
        module = profile.calls[parent]
        if module.parent is None or parent not in model.segments:
            continue
        calls = children[parent]
        own = own_op_count(module, calls)
        registered = all(c.registered for c in calls)  # the range over it names its calls by path
        if registered and own >= MIN_OWN_OPS and (best is None or own > best[0]):
            whole = SegmentDecision(
                module=module.fqn,
                call=parent,
                first_op=module.first_op,
                end_op=module.end_op,
                recompute_ms=0.0,
                within=module.fqn,
                calls=tuple(c.fqn for c in calls),
                own_ops=own,
            )
            best = (own, _Probe(call=parent, range=whole))
    return best[1] if best else None


def _timed(workload: Workload, whole: SegmentDecision) -> _Times:
    module = dict(workload.model.named_modules())[whole.within]
    (inputs,) = inputs_of(workload, [module])
    plain, checkpointed, ranged = (copy.deepcopy(module) for _ in range(3))
    inside = dict(ranged.named_modules())
    calls = [inside[path.removeprefix(f"{whole.within}.")] for path in whole.calls]
    RangeSegment(whole, ranged, calls, MachineryMarker()).install()
    runs = (
        forward_of(plain, inputs),
        forward_of(checkpointed, inputs, checkpointed=True),
        forward_of(ranged, inputs),
        step_of(checkpointed, inputs, checkpointed=True),
        step_of(ranged, inputs),
    )
    interleaved(runs, workload, 1)  # warm-up
    forward, checkpoint_forward, range_forward, checkpointed_step, range_step = zip(
        *interleaved(runs, workload, ROUNDS)
    )
    return _Times(
        forward_ms=statistics.median(forward),
        range_over_checkpoint_ms=statistics.median(r - c for r, c in zip(range_step, checkpointed_step)),
        range_forward_over_checkpoint_ms=statistics.median(r - c for r, c in zip(range_forward, checkpoint_forward)),
    )
