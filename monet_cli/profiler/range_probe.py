"""Price an op range's own ops on the model's own code.

``overheads.py`` times a range over a chain of one-argument ops. The model's own code costs
more per op: views with size lists, transposes, splits into lists, scalar arguments (on
tiny_gpt's attention a range's recorder took about 45 us per op in the forward, where the
chain priced recording and replay together at 2 to 34 us). So where the profile offers
ranges, the module holding the most own ops among their modules is run alone, on copies, on
the inputs it gets in the step: once under plain checkpoint and once as one op range over
its whole forward, interleaved. Both re-run the same ops under the same frame; what the range
adds is its tape, recording and replaying each own op, and that divided by the own ops is
the price of one.
"""

from __future__ import annotations

import copy
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.checkpoint import checkpoint

from monet_cli.core.profile import ModuleCall, Profile
from monet_cli.core.schedule import SegmentDecision
from monet_cli.core.segments import SegmentModel
from monet_cli.runtime.meter import MachineryMarker
from monet_cli.runtime.ranges import RangeSegment
from monet_cli.workload.step import Workload

MIN_OWN_OPS = 8
"""Fewer own ops than this leave the chain's price: timing noise would be most of it."""
ROUNDS = 21
"""Interleaved runs of each version, after one warm-up run of each."""


def measure_range_op_ms(workload: Workload, profile: Profile) -> float | None:
    """The cost of each of a range's own ops on this model, or None when no module qualifies
    (or it cannot run alone: a warning says why, and the chain's price stays)."""
    probe = _probe(SegmentModel(profile))
    if probe is None:
        return None
    decision, own_ops = probe
    try:
        added_ms = _added_ms(workload, decision)
    except Exception as err:  # a module that cannot run alone: the model's own step is not at stake
        warnings.warn(f"monet: op ranges keep the generic price per op: timing '{decision.within}' alone "
                      f"failed ({type(err).__name__}: {err})", stacklevel=2)
        return None
    return round(max(0.0, added_ms / own_ops), 6)


def _probe(model: SegmentModel) -> tuple[SegmentDecision, int] | None:
    """A range over the whole forward of the module, among those holding offered ranges, with
    the most own ops (not the model itself: it cannot run alone), and its own op count."""
    profile = model.profile
    children: dict[int, list[ModuleCall]] = {}
    for call in profile.calls:
        if call.parent is not None:
            children.setdefault(call.parent, []).append(call)
    best = None
    for parent in {r.parent for c, r in model.ranges.items() if c in model.segments}:
        module = profile.calls[parent]
        if module.parent is None or not module.checkpointable:
            continue
        calls = sorted(children.get(parent, []), key=lambda c: c.first_op)
        inside = {op for c in calls for op in range(c.first_op, c.end_op)}
        own = sum(op not in inside for op in range(module.first_op, module.end_op))
        if own >= MIN_OWN_OPS and (best is None or own > best[1]):
            decision = SegmentDecision(
                module=module.fqn, call=parent, first_op=module.first_op, end_op=module.end_op, recompute_ms=0.0,
                within=module.fqn, calls=tuple(c.fqn for c in calls), own_ops=own)
            best = (decision, own)
    return best


def _added_ms(workload: Workload, decision: SegmentDecision) -> float:
    """Median of what the range adds to plain checkpoint of its module, forward and backward, in ms."""
    parent = dict(workload.model.named_modules())[decision.within]
    inputs = _inputs_of(workload, parent)
    plain, ranged = copy.deepcopy(parent), copy.deepcopy(parent)
    inside = dict(ranged.named_modules())
    calls = [inside[path.removeprefix(f"{decision.within}.")] for path in decision.calls]
    RangeSegment(decision, ranged, calls, MachineryMarker()).install()
    rounds = _interleaved(_step(plain, inputs, checkpointed=True), _step(ranged, inputs), workload)
    return statistics.median(ranged_ms - plain_ms for plain_ms, ranged_ms in rounds)


def _inputs_of(workload: Workload, module: nn.Module) -> tuple[tuple, dict]:
    """What ``module`` is called with in the step, from one eval-mode forward without grad (it
    changes no BatchNorm statistics): floating tensors as leaves that take gradients."""
    taken: list[tuple[tuple, dict]] = []

    def take(_module: nn.Module, args: tuple, kwargs: dict) -> None:
        taken.append(tree_map(_leaf, (args, kwargs)))

    handle = module.register_forward_pre_hook(take, with_kwargs=True)
    was_training = workload.model.training
    workload.model.eval()
    try:
        with torch.no_grad(), workload.autocast():
            workload.run_model()
    finally:
        workload.model.train(was_training)
        handle.remove()
    (inputs,) = taken  # a range's module is called once per step
    return inputs


def _leaf(value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    return value.detach().clone().requires_grad_(value.is_floating_point())


def _step(module: nn.Module, inputs: tuple[tuple, dict], *, checkpointed: bool = False) -> Callable[[], None]:
    args, kwargs = inputs

    def run() -> None:
        output = checkpoint(module, *args, use_reentrant=False, **kwargs) if checkpointed else module(*args, **kwargs)
        outputs = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        torch.stack([t.float().sum() for t in outputs]).sum().backward()

    return run


def _interleaved(plain: Callable[[], None], ranged: Callable[[], None], workload: Workload) -> list[tuple[float, float]]:
    """(plain ms, ranged ms) of each round, the two run one after the other."""
    rounds = []
    for repeat in range(ROUNDS + 1):
        times = []
        for run in (plain, ranged):
            workload.sync()
            start = time.perf_counter()
            with workload.autocast():
                run()
            workload.sync()
            times.append((time.perf_counter() - start) * 1000)
        if repeat:  # the first round warms up
            rounds.append((times[0], times[1]))
    return rounds
