"""Price checkpoint's frame and its selective policy inside the model's own training step, and
time the step of the model as written.

``overheads.py`` prices both on a chain of tanh ops over eight numbers, alone. Inside a real
step they cost more. On tiny_gpt (batch 16, this 2-core CPU) a frame cost about 0.6 ms beyond
its 0.1 ms price, whatever it held (its recompute's Python and early stop, checkpoint's RNG
stash, the memory it makes and frees among the step's own); and the selective policy's
dispatch modes cost 30 to 40 us an op there and 65 to 135 on the unet, where tanh said 7 to
16. The probe
(``probe.py``) spread the frame's cost over the re-run ops of the one block it times, so whole
blocks were priced right and small segments (a LayerNorm and a Linear, an MLP) too cheap: the
solver chose many small segments and the step ran 8 to 12 points slower than predicted.

So the step itself is timed with module calls checkpointed as a schedule runs them (the
executor's ``checkpointed_forward``, their BatchNorms guarded), interleaved with plain steps.
The schedule's checks on every training forward (``runtime/guards.py``) are registered on the
root in every one of those steps, plain ones too, and their own time taken (``_TimedChecks``):
every schedule pays them, one with operator variants alone too, so they are priced apart
(``checks_ms``) from what checkpointing costs.
Priced on ``torch.utils.checkpoint`` alone, the unet's schedule of every block ran 1.5 to 2.0%
of the step slower than PyTorch's checkpoint of the same blocks in two runs of 61 and 201
interleaved repeats (12-05; 90% intervals -1.7 to +5.0% and -1.4 to +5.2%), and its
prediction matched PyTorch's. The sets:
- the cheapest calls to checkpoint (``FRAMES`` at most, none nested in another), the
  ``FEW_FRAMES`` cheapest of them, and the largest calls (none nested in another), each set
  against the plain step. What each set added beyond the profile's price is a cost the step
  pays once for checkpointing anything, so many frames and so many re-run ops: the three sets
  weigh them differently, so the three equations give the once (``first_frame_ms``), the
  frame's extra (added to ``segment_ms``) and each re-run op's (``python_op_ms``), the first
  and the last at least 0. On tiny_gpt a checkpointed GELU added 1.2 ms, four 2.9 and sixteen
  cheap calls 7.7: priced per frame alone, the 16 gave 0.48 ms a frame, and schedules of a
  few small segments ran 3 to 5 points slower than predicted. Timed on a block alone (as
  ``probe.py`` once did) the per-op cost came out at 5 to 10 us, where the step said none:
  schedules of whole blocks and ranges ran 2 to 3 ms (5 points of the step) faster than
  predicted;
- the largest calls under a selective policy that keeps nothing, against plain checkpoint:
  the difference, per op run under the policy in the forward and in the recompute, is
  ``policy_op_ms``.
The three sets run in rounds: the plain step and each set once, the order rotated from round
to round, each set's difference taken against its own round's plain step (``_interleaved``),
as many rounds as the steps of three measurements of ``pairs`` pairs (twice as many where the
step is noisy: ``NOISY_PRICES``; how far its noise may still move the prices is
``price_noise_ms``). Timed one set after another, each paired with its own plain steps, the
three spanned 25 s of a machine that changes speed within minutes. In a same-run comparison
(12-07, six runs on tiny_gpt and the unet, 22 profiles each way in alternation, every plan's
prediction against one interleaved measurement of 61 repeats) the rounds put 68 of 77
predictions within 3 points of the measured overhead against 56 of 77 (mean absolute miss 1.6
points against 2.2, one plan's predictions spreading at most 5.5 points against 16.4: one
profile of the sets timed apart, in a slow spell, priced a re-run op at 20 us and missed the
deepest plan by 11.0 points).
Each set is priced at its calls' walls timed again in plain steps between the rounds
(``CallTimer``, after every other round), and what it adds beyond that price is put in the
profile's time by those steps over the profile's. Priced at the profile's walls instead,
with the first set's speed for all, five gpt profiles in a row (12-05) left 1.8 to 7.0 ms
of the largest set's time unpriced, and 11.2 ms where the pricing ran 16% faster than the
profile's timed steps (a slow speed slows the backward more than the forward: ``retimed``);
priced at walls timed again, five more left 3.0 to 5.1 ms, all at one speed (the rest is
the noise of 30 pairs).
BatchNorm calls are left out, as they were when the sets ran under plain checkpoint (a
recompute then updated their statistics again). The guards now prevent that; letting them in
would change which calls the cheapest sets hold, and has not been measured. Where a step
is too slow to pair ``MIN_PAIRS`` times in ``BUDGET_S``, a few of its calls are timed alone
instead (``alone.py``). A profile of fewer timed steps (``--steps``) pairs fewer:
``PAIRS_PER_STEP`` per step.

``as_written_step_ms`` pairs the prepared step with the model as its factory built it.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from monet_cli.core.profile import Overheads, Profile
from monet_cli.core.segments import SegmentModel
from monet_cli.core.stats import median_interval
from monet_cli.profiler.alone import keeping_nothing
from monet_cli.profiler.capture import CallTimer, Timings, retimed
from monet_cli.runtime.executor import guard_batchnorms
from monet_cli.runtime.guards import install_guards, install_output_check
from monet_cli.workload.step import Workload

FRAMES = 16
"""Cheap calls checkpointed at once: their sum stands out of a step's noise."""
FEW_FRAMES = 4
"""The cheapest of them, checkpointed alone: against all ``FRAMES``, what the step pays once
for checkpointing anything stands apart from what each frame costs."""
BUDGET_S = 8.0
"""Per measurement (few and many frames, recomputes, policy, the model as written), its
warm-up pairs and walls steps included; the three sets' take twice it where the step is noisy
(``NOISY_PRICES``)."""
PAIRS_PER_STEP = 10
"""Pairs per timed step the profile was asked for (``--steps``): a quick profile pairs fewer."""
MIN_PAIRS, MAX_PAIRS = 9, 31
WARM_UP_PAIRS = 2
CONFIDENCE = 0.9
"""Of the interval ``price_noise_ms`` is half of."""
NOISY_PRICES = 0.03
"""Of the step: the time model's target is a predicted overhead within 3 points of the
measured. Where the largest calls' median difference holds to no better than this, the sets'
rounds run once more (twice the rounds narrow the interval by about 1/sqrt(2)), and the
profile warns where it still does not."""
WALLS_EVERY = 2
"""Rounds of the three sets per plain step with its calls timed. One after every pair (when
the sets were paired one after another) added about 7 s to tiny_gpt's profile and 39 s to the
real-model tests (12-05); every other pair's steps span the same stretch of time."""


def price_in_step(workload: Workload, profile: Profile, steps: int) -> Overheads:
    """``profile.overheads`` with ``checks_ms``, ``first_frame_ms``, ``segment_ms``,
    ``python_op_ms`` and ``policy_op_ms`` timed in the step (``steps``: the profile's
    ``--steps``), for a step that ``can_pair``; ``alone.price_alone`` prices the others."""
    pairs = _pairs(profile.baseline.step_ms, steps)
    unpriced = replace(profile, overheads=replace(profile.overheads, python_op_ms=0.0))
    model = SegmentModel(unpriced)
    cheapest = _calls(model, cheapest=True)
    if not cheapest:
        return profile.overheads
    largest = _calls(model, cheapest=False)
    modules = dict(workload.model.named_modules())

    sets = [cheapest[:FEW_FRAMES], cheapest, largest] if FEW_FRAMES < len(cheapest) else [cheapest, largest]
    toggles = {c: _Toggle(modules[model.calls[c].fqn]) for c in dict.fromkeys(c for calls in sets for c in calls)}
    checks = _TimedChecks(workload.model, profile)
    walls = Timings()
    try:
        switches = [_toggles([toggles[c] for c in calls]) for calls in sets]
        differences = _interleaved(workload, switches, pairs, walls, checks.set)
        if too_noisy(_half_width(differences[-1]), walls.median_step_ms()):
            more = _interleaved(workload, switches, pairs, walls, checks.set)
            differences = [first + second for first, second in zip(differences, more, strict=True)]
    finally:
        for toggle in toggles.values():
            toggle.close()
    measured = [
        _Checkpointed(unpriced, walls, calls, statistics.median(ms))
        for calls, ms in zip(sets, differences, strict=True)
    ]
    few, many, long = measured if len(measured) == 3 else (measured[0], *measured)
    once_ms, frame_ms, op_ms = _unpriced(few, many, long)
    policies = [_Toggle(modules[model.calls[c].fqn], policy=True) for c in largest]
    try:
        _, policy_ms = _paired(workload, _toggles(policies), pairs)
    finally:  # the first version is plain checkpoint
        for toggle in policies:
            toggle.close()
    ops = sum(model.segments[c].end_op - model.segments[c].first_op for c in largest)
    return replace(
        profile.overheads,
        checks_ms=round(checks.median_ms(), 6),
        first_frame_ms=round(once_ms, 6),
        segment_ms=round(max(0.0, profile.overheads.segment_ms + frame_ms), 6),
        python_op_ms=round(op_ms, 6),
        policy_op_ms=round(max(0.0, policy_ms / long.speed / (2 * ops)), 6),
        price_noise_ms=round(_half_width(differences[-1]) / long.speed, 6),
    )


class _Checkpointed:
    """Calls checkpointed together in the step: their frames, the ops their recomputes re-run,
    and the time they added beyond the model's price without a per-op extra. The price is
    taken from the calls' walls timed in plain steps paired with these (``walls``), in those
    steps' time, and the remainder put in the profile's time."""

    def __init__(self, profile: Profile, walls: Timings, calls: list[int], added_ms: float) -> None:
        now = retimed(profile, walls)
        model = SegmentModel(now)
        self.speed = now.baseline.step_ms / profile.baseline.step_ms
        """This machine's speed in these steps over the profile's."""
        self.frames = len(calls)
        self.ops = sum(model.segments[c].stop - model.segments[c].first_op for c in calls)
        self.unpriced_ms = (added_ms - sum(model.added_ms(c) for c in calls)) / self.speed


def _unpriced(few: _Checkpointed, many: _Checkpointed, long: _Checkpointed) -> tuple[float, float, float]:
    """What the step pays once, each frame and each re-run op beyond the price, from three
    sets of calls that weigh them differently (each set's unpriced time is the first, plus
    its frames times the second, plus its re-run ops times the third). The once and per-op
    costs are at least 0: where the three equations give less, that one is held at 0 and the
    rest solved from the two sets that weigh them most (few and many frames for the frame and
    the once, many frames and long recomputes for the frame and the op); where both, all of
    the many frames' unpriced time goes to frames."""
    tries = ((True, True, (few, many, long)), (True, False, (few, many)), (False, True, (many, long)))
    for with_once, with_op, sets in tries:
        rows = [[1.0] * with_once + [float(s.frames)] + [float(s.ops)] * with_op for s in sets]
        solution = _solve(rows, [s.unpriced_ms for s in sets])
        if solution is None:
            continue
        once_ms, op_ms = (solution[0] if with_once else 0.0), (solution[-1] if with_op else 0.0)
        if once_ms >= 0 and op_ms >= 0:
            return once_ms, solution[1 if with_once else 0], op_ms
    return 0.0, many.unpriced_ms / many.frames, 0.0


def too_noisy(noise_ms: float, step_ms: float) -> bool:
    """Whether the step's noise alone may move a deep schedule's predicted step by more than
    ``NOISY_PRICES`` of it (both in one machine's time)."""
    return noise_ms > NOISY_PRICES * step_ms


def _half_width(differences: list[float]) -> float:
    """Half the ``CONFIDENCE`` interval of the median of ``differences``."""
    low, high = median_interval(differences, CONFIDENCE)
    return (high - low) / 2


def _solve(rows: list[list[float]], values: list[float]) -> list[float] | None:
    """The solution of a small square linear system, or None when it has no single one (two
    sets that weigh everything alike)."""
    try:
        return torch.linalg.solve(
            torch.tensor(rows, dtype=torch.float64), torch.tensor(values, dtype=torch.float64)
        ).tolist()
    except torch.linalg.LinAlgError:
        return None


def as_written_step_ms(workload: Workload, step_ms: float, steps: int) -> float | None:
    """The step with the activations ``build_workload`` switched out of place back in place,
    paired with the prepared step, in the time of ``step_ms`` (the prepared step's, the median
    of ``steps``): None where nothing was switched or fewer than ``MIN_PAIRS`` pairs fit.

    Every schedule runs them out of place (selective checkpointing cannot keep a tensor an
    in-place op wrote), which the user's model does not: on the unet (batch 16, this CPU) that
    alone cost 7.5% of the step, which monet's predicted overhead had left out."""
    if not workload.out_of_place or not can_pair(step_ms, steps):
        return None

    def switch(as_written: bool) -> None:
        for module in workload.out_of_place:
            module.inplace = as_written

    prepared_ms, as_written_minus_prepared_ms = _paired(workload, switch, _pairs(step_ms, steps))
    return round(step_ms + as_written_minus_prepared_ms / (prepared_ms / step_ms), 4)


def can_pair(step_ms: float, steps: int) -> bool:
    """Whether a step of ``step_ms`` is short enough to pair ``MIN_PAIRS`` times in ``BUDGET_S``
    (``_pairs``)."""
    return _pairs(step_ms, steps) >= MIN_PAIRS


def _pairs(step_ms: float, steps: int) -> int:
    """Pairs to time: ``PAIRS_PER_STEP`` per timed step, at most ``MAX_PAIRS``, as many as fit
    in ``BUDGET_S`` with the warm-up pairs and the walls steps among them. Counting the pairs
    alone, the 96-layer LLaMA-style decoder (a 385 ms step) paired 10 times a measurement and
    spent 60 s of its 77 s profile pairing (12-05)."""
    pairs = min(MAX_PAIRS, PAIRS_PER_STEP * steps)
    while pairs > 0 and _steps_to_pair(pairs) * step_ms > BUDGET_S * 1000.0:
        pairs -= 1
    return pairs


def _steps_to_pair(pairs: int) -> int:
    """Steps a measurement of ``pairs`` runs at most: its warm-up pairs, its pairs, and a walls
    step after every ``WALLS_EVERY``-th pair."""
    return 2 * (WARM_UP_PAIRS + pairs) + math.ceil(pairs / WALLS_EVERY)


def _calls(model: SegmentModel, *, cheapest: bool) -> list[int]:
    """Module-call segments that are recomputed, none nested in another, none a BatchNorm:
    up to ``FRAMES`` of the cheapest to checkpoint, or the largest (most ops) first."""
    candidates = [
        c
        for c, seg in model.segments.items()
        if not seg.members
        and c not in model.ranges
        and seg.burst_pos is not None
        and "BatchNorm" not in model.calls[c].type
    ]
    if cheapest:
        candidates.sort(key=lambda c: (model.added_ms(c), c))
    else:
        candidates.sort(key=lambda c: (model.segments[c].first_op - model.segments[c].end_op, c))
    chosen = _apart(model, candidates)
    return chosen[:FRAMES] if cheapest else chosen


def _apart(model: SegmentModel, candidates: Iterable[int]) -> list[int]:
    """The candidates, in order, that share no op with one taken before."""
    chosen: list[int] = []
    for c in candidates:
        seg = model.segments[c]
        if all(seg.end_op <= model.segments[d].first_op or model.segments[d].end_op <= seg.first_op for d in chosen):
            chosen.append(c)
    return chosen


class _Toggle:
    """A module's forward, switched between two versions: plain and as a schedule checkpoints
    it, or (``policy``) as a schedule checkpoints it and the same under its keep policy
    keeping nothing. Its BatchNorms are guarded as a schedule guards them until ``close``."""

    def __init__(self, module: nn.Module, *, policy: bool = False) -> None:
        self.module = module
        self.own = module.__dict__.get("forward")
        """A forward set on the instance before (None: the class's)."""
        checkpointed = keeping_nothing(module)
        self.versions = (checkpointed, keeping_nothing(module, selective=True)) if policy else (None, checkpointed)
        """The two versions; None: the plain forward."""
        self.unguard = guard_batchnorms(module)

    def set(self, second: bool) -> None:
        version = self.versions[second]
        if version is None:
            self.restore()
        else:
            self.module.forward = version

    def restore(self) -> None:
        if self.own is not None:
            self.module.forward = self.own
        else:
            self.module.__dict__.pop("forward", None)

    def close(self) -> None:
        """The plain forward again, and the BatchNorms unguarded."""
        self.restore()
        self.unguard()


class _TimedChecks:
    """The checks a schedule runs on every training forward (``runtime/guards.py``), on or off,
    with the time their hooks take in each forward (timing hooks registered just before and
    just after them, on the root's pre-hooks and its forward hooks). On tiny_gpt (batch 16,
    12-07) a schedule of no segment ran 0.2 to 0.6 ms a step slower than the prepared model
    without it, in six interleaved measurements of 61 to 101 repeats, and its hooks' own code
    took 0.28 ms; a step's difference would weigh 0.3 ms against its noise of about as much."""

    def __init__(self, model: nn.Module, profile: Profile) -> None:
        self.model = model
        self.profile = profile
        self.handles: list[RemovableHandle] = []
        self.forwards_s: list[float] = []
        """Each forward's time in the checks' hooks."""
        self.began = self.spent = 0.0

    def set(self, on: bool) -> None:
        if on == bool(self.handles):  # as they are: the rounds switch them on each time
            return
        for handle in self.handles:
            handle.remove()
        self.handles = []
        if on:
            model, fingerprint = self.model, self.profile.fingerprint
            self.handles = [model.register_forward_pre_hook(self._start), model.register_forward_hook(self._resume)]
            # Without the hook check: each walls step switches them off and on, so the check
            # would compare the model's hooks on every other round, where a schedule compares
            # them once.
            self.handles += install_guards(model, fingerprint, self.profile.model, check_hooks=False)
            self.handles += install_output_check(model, fingerprint)
            self.handles += [model.register_forward_pre_hook(self._pause), model.register_forward_hook(self._end)]

    def median_ms(self) -> float:
        return 1000.0 * statistics.median(self.forwards_s) if self.forwards_s else 0.0

    def _start(self, module: nn.Module, args: Any) -> None:
        self.began, self.spent = time.perf_counter(), 0.0

    def _pause(self, module: nn.Module, args: Any) -> None:
        self.spent += time.perf_counter() - self.began

    def _resume(self, module: nn.Module, args: Any, output: Any) -> None:
        self.began = time.perf_counter()

    def _end(self, module: nn.Module, args: Any, output: Any) -> None:
        self.forwards_s.append(self.spent + time.perf_counter() - self.began)


def _toggles(toggles: list[_Toggle]) -> Callable[[bool], None]:
    def switch(second: bool) -> None:
        for toggle in toggles:
            toggle.set(second)

    return switch


def _paired(workload: Workload, switch: Callable[[bool], None], pairs: int) -> tuple[float, float]:
    """Median step with ``switch(False)``, and median paired difference (``switch(True)`` minus
    it), in ms; ``switch(False)`` again at the end."""
    first, added = [], []
    try:
        for k in range(WARM_UP_PAIRS + pairs):
            times = {}
            for second in (False, True) if k % 2 else (True, False):
                switch(second)
                times[second] = workload.timed_step()
            if k >= WARM_UP_PAIRS:
                first.append(times[False])
                added.append(times[True] - times[False])
    finally:
        switch(False)
    return statistics.median(first), statistics.median(added)


def _interleaved(
    workload: Workload,
    switches: list[Callable[[bool], None]],
    pairs: int,
    walls: Timings,
    checks: Callable[[bool], None],
) -> list[list[float]]:
    """Each switch's differences (``switch(True)`` minus the plain step of the same round),
    in ms, all with the schedule's ``checks`` switched on. A round runs the plain step
    and each switch on in turn, its order rotated from round to round, so every set is timed
    at the speed the others are and against the same plain steps; every ``WALLS_EVERY``-th
    round is followed by a plain step, without the checks, whose module calls are timed
    (``CallTimer``), into ``walls``. As many rounds as the steps of one
    ``pairs``-pair measurement per switch: timed one after the other, three sets of 31 pairs
    spanned 25 s of a machine that changes speed within minutes."""
    versions = len(switches) + 1  # 0: the plain step

    def only(version: int) -> None:
        for switch in switches:  # the sets may share calls: all off, then one on
            switch(False)
        if version:
            switches[version - 1](True)

    rounds = _rounds(versions, len(switches) * _steps_to_pair(pairs))
    added: list[list[float]] = [[] for _ in switches]
    try:
        for r in range(WARM_UP_PAIRS + rounds):
            checks(True)  # off only for the walls steps; the warm-up's few forwards barely move its median
            order = [(r + v) % versions for v in range(versions)]
            times = {}
            for version in order:
                only(version)
                times[version] = workload.timed_step()
            if r < WARM_UP_PAIRS:
                continue
            for k in range(1, versions):
                added[k - 1].append(times[k] - times[0])
            if (r - WARM_UP_PAIRS) % WALLS_EVERY == 0:
                only(0)
                checks(False)
                step_ms, call_ms = CallTimer(workload).step()
                walls.step_ms.append(step_ms)
                walls.call_ms.append(call_ms)
    finally:
        only(0)
        checks(False)
    return added


def _rounds(versions: int, steps: int) -> int:
    """Rounds of ``versions`` steps each, with the warm-up rounds and the walls steps, that
    run at most ``steps`` steps."""
    rounds = 0
    while versions * (WARM_UP_PAIRS + rounds + 1) + math.ceil((rounds + 1) / WALLS_EVERY) <= steps:
        rounds += 1
    return rounds
