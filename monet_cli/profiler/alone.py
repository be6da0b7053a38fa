"""Run one of the model's module calls alone: on copies, on the inputs it gets in the step,
its versions interleaved round by round. ``probe.py`` prices an op range's tape this way, and
``price_alone`` prices checkpoint's frame where the step is too slow to pair
(``in_step.py``).

Where the step is too slow to pair, the frame used to keep the tanh chain's price
(``overheads.py``), and on resnet50 (batch 32, 128 px, this 2-core CPU) every monet point ran
slower than predicted, by 0.7 to 5.2 points in one run and 2.6 to 6.9 in another. Its
Bottlenecks timed alone, each checkpointed as a schedule runs it (the executor's
checkpointed forward, its BatchNorms guarded) against the same Bottleneck plain, added 0.3 to
4.8 ms (about 2 on average) beyond their price (recompute at the call's wall time, plus the
chain's 0.2 ms a frame), 15 interleaved rounds each (12-05): about 2% of the step over 16
Bottlenecks, where the bench's time gap had measured the machinery at 2.3% of the step
against 0.4% priced. On the unet the same gave 0.3 to 0.5 ms for a call of one or two ops and
0.5 to 1.0 ms for a block of ten, where its profile's in-step prices said a once of 1.7 ms
and 0.35 ms for a block's re-run ops.

Timed alone, a call can cost more than in the step: on tiny_gpt a block alone put 5 to 10 us
on each re-run op where its step said none, and plans of whole blocks then ran 2 to 3 ms (5
points of the step) faster than predicted. So the step prices checkpoint wherever it can be
paired, and calls alone only where it cannot.

So a few calls are timed alone, the largest that fit the budget and the cheapest to
checkpoint, and what each added beyond its price is split into a cost per frame and one per
re-run op (least squares over the calls, both at least 0). Each call alone is its own step,
so what a step pays once for checkpointing anything is part of every call's frame here: a
schedule of many frames is priced high rather than low. The largest calls also run under a
selective policy that keeps nothing, which prices the policy per op.
"""

from __future__ import annotations

import copy
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.checkpoint import checkpoint

from monet_cli.core.profile import Overheads, Profile
from monet_cli.core.segments import SegmentModel
from monet_cli.runtime.executor import checkpointed_forward, guard_batchnorms
from monet_cli.runtime.meter import MachineryMarker
from monet_cli.workload.step import Workload

LARGEST, CHEAPEST = 2, 2
"""Calls timed alone: the largest (most ops) that fit the budget, and the cheapest to checkpoint."""
BUDGET_S = 16.0
"""For all the calls timed alone, shared evenly."""
SHARE_MS = BUDGET_S * 1000.0 / (LARGEST + CHEAPEST)
"""Each call's share, which picks the calls that fit and sizes their rounds."""
ROUND_WALLS = 12.0
"""A round of a call's versions (its forward, and its step plain, checkpointed and under the
policy) in multiples of the call's forward wall time, to pick calls that fit the budget."""
MIN_ROUNDS, MAX_ROUNDS = 9, 21


def price_alone(workload: Workload, profile: Profile) -> Overheads:
    """``profile.overheads`` with ``segment_ms``, ``python_op_ms`` and ``policy_op_ms`` timed on
    the model's own calls alone (else unchanged; a warning says why when a call cannot run alone)."""
    model = SegmentModel(replace(profile, overheads=replace(profile.overheads, python_op_ms=0.0)))
    calls = _chosen(model)
    if not calls:
        return profile.overheads
    named = dict(workload.model.named_modules())
    modules = [named[model.segments[c].fqn] for c in calls]
    try:
        inputs = inputs_of(workload, modules)  # one forward for all of them
        timed = [
            _timed(workload, model, c, module, given, policy=c in calls[:LARGEST])
            for c, module, given in zip(calls, modules, inputs)
        ]
    except Exception as err:  # a call that cannot run alone: the model's own step is not at stake
        warnings.warn(
            f"monet: checkpoint keeps its generic prices: timing a call alone failed ({type(err).__name__}: {err})",
            stacklevel=2,
        )
        return profile.overheads
    frame_ms, op_ms = frame_and_op_ms([(t.ops, t.unpriced_ms) for t in timed])
    policies = [t for t in timed if t.policy_ms is not None]
    policy_ops = sum(2 * t.ops for t in policies)  # forward and recompute
    policy_op_ms = sum(t.policy_ms for t in policies) / policy_ops if policy_ops else profile.overheads.policy_op_ms
    return replace(
        profile.overheads,
        segment_ms=round(profile.overheads.segment_ms + frame_ms, 6),
        python_op_ms=round(op_ms, 6),
        policy_op_ms=round(max(0.0, policy_op_ms), 6),
    )


def frame_and_op_ms(points: list[tuple[int, float]]) -> tuple[float, float]:
    """The least-squares line through (ops, unpriced ms): its value at 0 ops is the frame's cost,
    its slope each re-run op's, both at least 0 (where one comes out below, it is held at 0 and
    the other fitted alone)."""
    n = len(points)
    mean_ops = sum(o for o, _ in points) / n
    mean_ms = sum(u for _, u in points) / n
    spread = sum((o - mean_ops) ** 2 for o, _ in points)
    op_ms = sum((o - mean_ops) * (u - mean_ms) for o, u in points) / spread if spread else 0.0
    frame_ms = mean_ms - op_ms * mean_ops
    if op_ms <= 0:  # also where every call re-runs as many ops: nothing tells ops from frames
        return max(0.0, mean_ms), 0.0
    if frame_ms < 0:
        return 0.0, max(0.0, sum(o * u for o, u in points) / sum(o * o for o, _ in points))
    return frame_ms, op_ms


def _chosen(model: SegmentModel) -> list[int]:
    """The ``LARGEST`` calls with the most ops whose rounds fit their share of the budget,
    then the ``CHEAPEST`` to checkpoint among the rest: module calls of the model's own tree
    (not the model itself), recomputed, no BatchNorm (none in the in-step sets either)."""
    profile = model.profile
    candidates = [
        c
        for c, seg in model.segments.items()
        if not seg.members
        and c not in model.ranges
        and seg.burst_pos is not None
        and profile.calls[c].parent is not None
        and profile.calls[c].registered
        and (profile.calls[c].time_ms or 0.0) > 0.0  # its forward alone against it gives the speed
        and "BatchNorm" not in profile.calls[c].type
    ]
    fitting = [c for c in candidates if ROUND_WALLS * profile.calls[c].time_ms * MIN_ROUNDS <= SHARE_MS]
    largest = sorted(fitting, key=lambda c: (model.segments[c].first_op - model.segments[c].end_op, c))[:LARGEST]
    rest = sorted((c for c in fitting if c not in largest), key=lambda c: (model.added_ms(c), c))
    return largest + rest[:CHEAPEST]


@dataclass(frozen=True, kw_only=True, slots=True)
class _Alone:
    ops: int
    """Ops its recompute re-runs."""
    unpriced_ms: float
    """What checkpointing it added beyond its price, in the profile's time."""
    policy_ms: float | None
    """What the policy keeping nothing added to checkpointing it, in the profile's time (None: not timed)."""


def _timed(
    workload: Workload,
    model: SegmentModel,
    call: int,
    module: nn.Module,
    inputs: tuple[tuple, dict],
    *,
    policy: bool,
) -> _Alone:
    """``call`` timed alone: ``module`` is its module, ``inputs`` what it gets in the step."""
    seg = model.segments[call]
    plain = copy.deepcopy(module)
    versions = [_as_scheduled(module, selective) for selective in ((False, True) if policy else (False,))]
    runs = (forward_of(plain, inputs), step_of(plain, inputs), *(step_of(v, inputs) for v in versions))
    warm_up = interleaved(runs, workload, 1)[0]
    rounds = interleaved(runs, workload, min(MAX_ROUNDS, max(MIN_ROUNDS, int(SHARE_MS / sum(warm_up)))))
    speed = statistics.median(r[0] for r in rounds) / model.profile.calls[call].time_ms  # now over the profile's steps
    added = statistics.median(r[2] - r[1] for r in rounds) / speed
    return _Alone(
        ops=seg.stop - seg.first_op,
        unpriced_ms=added - model.added_ms(call),
        policy_ms=statistics.median(r[3] - r[2] for r in rounds) / speed if policy else None,
    )


def _as_scheduled(module: nn.Module, selective: bool) -> nn.Module:
    """A copy of ``module`` checkpointed as a schedule runs it, its BatchNorms guarded."""
    version = copy.deepcopy(module)
    version.forward = keeping_nothing(version, selective=selective)
    guard_batchnorms(version)  # a copy: no guard to remove after
    return version


def keeping_nothing(module: nn.Module, *, selective: bool = False) -> Callable[..., Any]:
    """``module``'s forward as a schedule checkpoints it keeping nothing (``selective``: under
    the keep policy all the same, which prices the policy)."""
    return checkpointed_forward(module, frozenset(), MachineryMarker(), selective=selective)


def inputs_of(workload: Workload, modules: list[nn.Module]) -> list[tuple[tuple, dict]]:
    """What each of ``modules`` is called with in the step, from one ``Workload.observe_forward``:
    floating tensors as leaves that take gradients."""
    taken: dict[int, list[tuple[tuple, dict]]] = {id(m): [] for m in modules}

    def take(module: nn.Module, args: tuple, kwargs: dict) -> None:
        taken[id(module)].append(tree_map(_leaf, (args, kwargs)))

    handles = [m.register_forward_pre_hook(take, with_kwargs=True) for m in modules]
    try:
        workload.observe_forward()
    finally:
        for handle in handles:
            handle.remove()
    return [inputs for (inputs,) in (taken[id(m)] for m in modules)]  # a segment candidate is called once per step


def _leaf(value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    return value.detach().clone().requires_grad_(value.is_floating_point())


def forward_of(module: nn.Module, inputs: tuple[tuple, dict], *, checkpointed: bool = False) -> Callable[[], Any]:
    """The module's forward on ``inputs`` (``checkpointed``: under plain non-reentrant checkpoint)."""
    args, kwargs = inputs

    def run() -> Any:
        return checkpoint(module, *args, use_reentrant=False, **kwargs) if checkpointed else module(*args, **kwargs)

    return run


def step_of(module: nn.Module, inputs: tuple[tuple, dict], *, checkpointed: bool = False) -> Callable[[], None]:
    """Its forward and a backward from the sum of every output that takes gradients."""
    forward = forward_of(module, inputs, checkpointed=checkpointed)

    def run() -> None:
        output = forward()
        outputs = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        torch.stack([t.float().sum() for t in outputs]).sum().backward()

    return run


def interleaved(runs: tuple[Callable[[], Any], ...], workload: Workload, rounds: int) -> list[list[float]]:
    """Each round's ms of every run, one after the other."""
    timed = []
    for _ in range(rounds):
        times = []
        for run in runs:
            workload.sync()
            start = time.perf_counter()
            with workload.autocast():
                run()
            workload.sync()
            times.append((time.perf_counter() - start) * 1000)
        timed.append(times)
    return timed
