"""What checkpointing costs beyond re-running ops, measured on the target device.

Chains of cheap ops, each saving one tensor, run forward and backward plainly, under
non-reentrant checkpoint, and under checkpoint with a selective policy. The machinery of a
checkpointed chain (its time minus the plain step and minus a forward that builds the
graph, which is what the recompute re-runs) grows with the tensors the frame saves: a
short and a long chain give the fixed cost of one checkpointed call and the cost of each
saved tensor (packed in the forward and again in the recompute, then unpacked). The
selective policy's dispatch modes add a cost per op. The same chain as a module's forward
under an op range (``runtime/ranges.py``) gives the cost of each of a range's own ops: written
to the tape in the forward, replayed from it in the recompute, both in Python. Small on a
large model, but a real share of the step on a small fast one.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from monet_cli.core.profile import Overheads
from monet_cli.core.schedule import SegmentDecision
from monet_cli.runtime.meter import MachineryMarker
from monet_cli.runtime.ranges import RangeSegment

SHORT, LONG = 4, 44
"""Chain lengths; tanh saves its output, so each op adds one saved tensor."""
REPS = 100
RANGE_REPS = 20
"""The op range's chain runs its ops in Python twice (tape and replay): fewer repetitions."""
ROUNDS = 5


def _chain(length: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(x: torch.Tensor) -> torch.Tensor:
        for _ in range(length):
            x = torch.tanh(x)
        return x

    return run


class _OwnOps(nn.Module):
    """The chain as a module's own code: an op range over its whole forward records every op."""

    def __init__(self, length: int) -> None:
        super().__init__()
        self.run = _chain(length)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(x)


def _ranged(length: int) -> nn.Module:
    module = _OwnOps(length)
    decision = SegmentDecision(
        module="<chain>", call=0, first_op=0, end_op=length, recompute_ms=0.0, within="", own_ops=length
    )
    RangeSegment(decision, module, [], MachineryMarker()).install()
    return module


def _recompute_all(ctx, op, *args, **kwargs):
    return CheckpointPolicy.PREFER_RECOMPUTE


def _median_ms(step: Callable[[], None], device: torch.device, reps: int = REPS) -> float:
    rounds = []
    for _ in range(ROUNDS):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(reps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        rounds.append((time.perf_counter() - start) / reps * 1000.0)
    return statistics.median(rounds)


def _checkpoint_ms(length: int, x: torch.Tensor, device: torch.device) -> tuple[float, float]:
    """(step time, machinery) of the chain under plain checkpoint, in ms: the machinery is that
    step minus the plain step and minus a forward that builds the graph (what the recompute re-runs)."""
    chain = _chain(length)

    def plain() -> None:
        chain(x).sum().backward()

    def graph_forward() -> None:
        chain(x)

    def checkpointed() -> None:
        checkpoint(chain, x, use_reentrant=False).sum().backward()

    for fn in (plain, graph_forward, checkpointed):  # warm-up
        fn()
    t_plain, t_forward, t_checkpoint = (_median_ms(fn, device) for fn in (plain, graph_forward, checkpointed))
    return t_checkpoint, t_checkpoint - t_plain - t_forward


def _on_top_ms(length: int, x: torch.Tensor, device: torch.device, t_checkpoint: float) -> tuple[float, float]:
    """(selective policy, op range) on top of plain checkpoint of the same chain (``t_checkpoint``), in ms."""
    chain = _chain(length)
    ranged = _ranged(length)

    def selective() -> None:
        context = lambda: create_selective_checkpoint_contexts(_recompute_all)  # noqa: E731
        checkpoint(chain, x, use_reentrant=False, context_fn=context).sum().backward()

    def as_range() -> None:
        ranged(x).sum().backward()

    for fn in (selective, as_range):  # warm-up
        fn()
    return _median_ms(selective, device) - t_checkpoint, _median_ms(as_range, device, RANGE_REPS) - t_checkpoint


@functools.cache  # a property of the device and torch, not of the model: measured once per process
def measure_overheads(device: torch.device) -> Overheads:
    x = torch.randn(8, device=device, requires_grad=True)
    _, short = _checkpoint_ms(SHORT, x, device)
    t_long, long = _checkpoint_ms(LONG, x, device)
    policy, ranged = _on_top_ms(LONG, x, device, t_long)
    saved_tensor_ms = max(0.0, (long - short) / (LONG - SHORT))
    return Overheads(
        segment_ms=round(max(0.0, short - SHORT * saved_tensor_ms), 5),
        saved_tensor_ms=round(saved_tensor_ms, 6),
        policy_op_ms=round(max(0.0, policy / (2 * LONG)), 6),  # forward and recompute
        range_op_ms=round(max(0.0, ranged / LONG), 6),  # beyond what plain checkpoint costs per op
    )
