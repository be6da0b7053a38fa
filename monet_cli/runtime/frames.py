"""Checkpoint frames around arbitrary code, for segments that are not one module call.

``torch.utils.checkpoint`` implements non-reentrant checkpointing as a generator around its
function: the first step saves the arguments, stashes the RNG state and enters the frame's
saved-tensor hooks; the code between the two steps runs inside the frame; the second step
leaves it. In backward the frame calls the function (the recompute) under the stashed RNG
state. A chain and an op range drive that generator from module hooks. It is private API
with the same positional signature in torch 2.11 and 2.14.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import _checkpoint_without_reentrant_generator

from monet_cli.runtime.meter import MachineryMarker


def open_frame(
    recompute: Callable[..., Any], context_fn: Callable[[], Any], marker: MachineryMarker, *tensors: torch.Tensor
) -> Any:
    """Enter a frame whose recompute is ``recompute(*tensors)``; returns it, open."""
    frame = _checkpoint_without_reentrant_generator(recompute, True, context_fn, "default", False, True, *tensors)
    with marker:
        next(frame)
    return frame


def close_frame(frame: Any, marker: MachineryMarker) -> None:
    """Leave a frame whose code ran to its end."""
    with marker:
        try:
            next(frame)
        except StopIteration:
            return
    raise AssertionError("internal error: checkpoint's frame did not close")


def abandon_frame(frame: Any, marker: MachineryMarker) -> None:
    """Leave a frame whose code raised: its hooks come off the stack."""
    with marker:
        frame.close()
