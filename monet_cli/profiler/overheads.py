"""What checkpointing costs beyond re-running ops, measured on the target device.

A tiny chain of cheap ops runs forward and backward plainly, under non-reentrant
checkpoint, and under checkpoint with a selective policy. The differences give the
fixed cost of one checkpointed call and the per-op cost of the policy's dispatch modes:
small on a large model, but a real share of the step on a small fast one.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from monet_cli.core.profile import Overheads

CHAIN_OPS = 20
REPS = 100
ROUNDS = 5


def _chain(x: torch.Tensor) -> torch.Tensor:
    for _ in range(CHAIN_OPS):
        x = torch.tanh(x)
    return x


def _recompute_all(ctx, op, *args, **kwargs):
    return CheckpointPolicy.PREFER_RECOMPUTE


def _median_ms(step: Callable[[], None], device: torch.device) -> float:
    rounds = []
    for _ in range(ROUNDS):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(REPS):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        rounds.append((time.perf_counter() - start) / REPS * 1000.0)
    return statistics.median(rounds)


@functools.cache  # a property of the device and torch, not of the model: measured once per process
def measure_overheads(device: torch.device) -> Overheads:
    x = torch.randn(8, device=device, requires_grad=True)

    def plain() -> None:
        _chain(x).sum().backward()

    def forward_only() -> None:
        with torch.no_grad():
            _chain(x)

    def checkpointed() -> None:
        checkpoint(_chain, x, use_reentrant=False).sum().backward()

    def selective() -> None:
        context = lambda: create_selective_checkpoint_contexts(_recompute_all)  # noqa: E731
        checkpoint(_chain, x, use_reentrant=False, context_fn=context).sum().backward()

    for fn in (plain, checkpointed, selective):  # warm-up
        fn()
    t_plain, t_forward = _median_ms(plain, device), _median_ms(forward_only, device)
    t_checkpoint, t_selective = _median_ms(checkpointed, device), _median_ms(selective, device)
    segment_ms = max(0.0, t_checkpoint - t_plain - t_forward)  # minus the re-run the profile already prices
    policy_op_ms = max(0.0, (t_selective - t_checkpoint) / (2 * CHAIN_OPS))  # forward and recompute
    return Overheads(segment_ms=round(segment_ms, 5), policy_op_ms=round(policy_op_ms, 6))
