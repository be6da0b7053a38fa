"""monet: plan and apply activation checkpointing so PyTorch training fits a memory budget."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:
    from torch import nn

    from monet_cli.core.schedule import Schedule


def apply(model: nn.Module, schedule: Schedule | str | Path, *, check_fingerprint: bool = True) -> nn.Module:
    """Install a schedule on your own model (before DDP/FSDP wrapping) and return it.

    The training loop stays unchanged. The first training forward checks the model's
    fingerprint against the schedule and raises ``monet_cli.errors.FingerprintError``
    when the schedule was made for another model, batch size, device type or torch. Every
    training forward raises it when the model has forward hooks its profile did not see
    (register them in the model's factory), when the batch pads where the profile's did
    not, when the previous training forward still waits for its backward, and when its
    output holds more tensor bytes than the profiled forward's (hidden states asked for).
    ``check_fingerprint=False`` skips the fingerprint and hook checks.
    """
    from monet_cli.runtime.executor import apply_schedule

    return apply_schedule(model, schedule, check_fingerprint=check_fingerprint)


__all__ = ["__version__", "apply"]
