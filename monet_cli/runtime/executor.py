"""Apply a schedule to a model: checkpointed segments with a per-op keep policy, and
operator variants outside them.

Each scheduled module's ``forward`` runs under non-reentrant ``torch.utils.checkpoint``
(``preserve_rng_state=True``, so dropout draws the same mask on recompute) with a
selective-checkpointing policy that keeps exactly the ops the schedule marks ``keep``,
keyed by (aten overload, occurrence within the segment). BatchNorm layers inside a
segment are guarded so a recompute does not update their running statistics again.
On the first forward the op sequence is fingerprinted and checked against the schedule.
"""

from __future__ import annotations

import functools
import warnings
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

from monet_cli.core.schedule import Schedule, load_schedule
from monet_cli.errors import CheckpointConflictError, FingerprintError
from monet_cli.runtime.fingerprint import FirstForwardCheck, warn_if_untested_torch
from monet_cli.runtime.meter import MachineryMarker
from monet_cli.runtime.variants import install_variants
from monet_cli.workload.step import make_out_of_place, turn_off_kv_cache

_APPLIED = "_monet_schedule"
_MACHINERY = "_monet_machinery"


def apply_schedule(model: nn.Module, schedule: Schedule | str | Path, *, check_fingerprint: bool = True) -> nn.Module:
    """Install ``schedule`` on ``model`` (before DDP/FSDP wrapping) and return the model."""
    if not isinstance(schedule, Schedule):
        schedule = load_schedule(Path(schedule))
    if getattr(model, _APPLIED, None) is not None:
        raise FingerprintError("a monet schedule is already applied to this model")
    warn_if_untested_torch()
    refuse_existing_checkpointing(model)
    model.register_forward_pre_hook(_refuse_on_training_forward)
    if turn_off_kv_cache(model):
        warnings.warn("monet: set model.config.use_cache = False for training, as transformers' own gradient "
                      "checkpointing does: a recompute would fill the key/value cache twice", stacklevel=3)
    if schedule.model.out_of_place_activations:
        make_out_of_place(model)
    modules = dict(model.named_modules())
    marker = MachineryMarker()
    for segment in schedule.segments:
        module = modules.get(segment.module)
        if module is None:
            raise FingerprintError(
                f"schedule segment '{segment.module}' is not a module of this model "
                "(the schedule was made for another model)"
            )
        keep = frozenset((k.op, k.occurrence) for k in schedule.kept_in(segment.module))
        _wrap_forward(module, keep, marker)
        _guard_batchnorms(module)
    install_variants(model, schedule.variants, marker)
    if check_fingerprint:
        FirstForwardCheck(model, schedule.fingerprint, marker).install()
    setattr(model, _APPLIED, schedule)
    setattr(model, _MACHINERY, marker)
    return model


def applied_schedule(model: nn.Module) -> Schedule | None:
    return getattr(model, _APPLIED, None)


def machinery(model: nn.Module) -> MachineryMarker | None:
    """The flag that is up while checkpoint's own bookkeeping runs in ``model``'s segments."""
    return getattr(model, _MACHINERY, None)


def existing_checkpointing(model: nn.Module) -> str | None:
    """Where the model already checkpoints activations itself, in words (None: nowhere)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    for name, module in model.named_modules():
        where = f"'{name}'" if name else "the model"
        if getattr(module, "gradient_checkpointing", False) is True:
            return (f"{where} has Hugging Face gradient checkpointing on: turn it off (model.gradient_checkpointing_disable(), "
                    "or leave gradient_checkpointing out of TrainingArguments)")
        if getattr(module, "grad_checkpointing", False) is True:
            return f"{where} has timm gradient checkpointing on: call model.set_grad_checkpointing(False)"
        if isinstance(module, CheckpointWrapper):
            return f"{where} is wrapped by torch's checkpoint_wrapper (apply_activation_checkpointing): remove it"
    return None


def refuse_existing_checkpointing(model: nn.Module) -> None:
    problem = existing_checkpointing(model)
    if problem is not None:
        raise CheckpointConflictError(f"monet's schedule decides what is recomputed, but {problem}")


def _refuse_on_training_forward(model: nn.Module, args: Any) -> None:
    # Trainers switch checkpointing on after the model is built (TrainingArguments(gradient_checkpointing=True)).
    if model.training and torch.is_grad_enabled():
        refuse_existing_checkpointing(model)


def _keep_policy(keep: frozenset[tuple[str, int]]) -> Callable[[], Any]:
    """A fresh per-call context: counts ops per overload, keeps the scheduled ones."""

    def context_fn():
        # Forward and recompute count apart: torch 2.11 asks the policy again in the recompute
        # (2.14 does not), and one shared count would miss every kept op there (re-running it
        # and holding both copies).
        counters: dict[bool, dict[str, int]] = {False: defaultdict(int), True: defaultdict(int)}

        def policy(ctx, op, *args, **kwargs):
            name = str(op)
            seen = counters[ctx.is_recompute]
            occurrence = seen[name]
            seen[name] += 1
            if (name, occurrence) in keep:
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    return context_fn


def _wrap_forward(module: nn.Module, keep: frozenset[tuple[str, int]], marker: MachineryMarker) -> None:
    original = module.forward
    # Keeping nothing is plain checkpointing: skip the selective policy's dispatch modes,
    # which cost Python time on every op of the segment, in forward and in recompute.
    context_fn = _keep_policy(keep) if keep else noop_context_fn

    # Recompute calls ``original`` directly, not through ``module(...)``, so a BatchNorm
    # that is itself the segment gets its guard here rather than from module hooks.
    guard_self = isinstance(module, nn.modules.batchnorm._BatchNorm)

    def run_original(*args: Any, **kwargs: Any) -> Any:
        # The model's own ops: not machinery, whether checkpoint runs them in the forward
        # (inside the segment's call) or in a recompute during backward (outside any call).
        outside, marker.depth = marker.depth, 0
        try:
            if guard_self:
                _bn_pre_hook(module, args)
            try:
                return original(*args, **kwargs)
            finally:
                if guard_self:
                    _bn_post_hook(module, args, None)
        finally:
            marker.depth = outside

    @functools.wraps(original)
    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)  # eval / no_grad: nothing to save
        tensors, rebuild = _tensors_apart(args, kwargs)

        def run_rebuilt(*values: torch.Tensor) -> Any:
            call_args, call_kwargs = rebuild(values)
            return run_original(*call_args, **call_kwargs)

        with marker:  # checkpoint's own bookkeeping, up to the model's ops in run_original
            return checkpoint(
                run_rebuilt, *tensors, use_reentrant=False, preserve_rng_state=True,
                context_fn=context_fn, determinism_check="default",
            )

    module.forward = checkpointed


def _tensors_apart(args: tuple, kwargs: dict) -> tuple[list[torch.Tensor], Callable[[tuple], tuple[tuple, dict]]]:
    """Every tensor argument, positional or not, and how to put the call back together.

    checkpoint saves its positional tensors through autograd's saved-tensor hooks, so a
    segment nested in another one lets the outer segment drop and recompute them; tensors
    in keyword arguments or containers it would hold strongly. The rebuild closes over the
    arguments with their tensors taken out, so it holds none of them either."""
    leaves, spec = tree_flatten((args, kwargs))
    at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    tensors = [leaves[i] for i in at]
    for i in at:
        leaves[i] = None

    def rebuild(values: tuple) -> tuple[tuple, dict]:
        filled = list(leaves)
        for i, value in zip(at, values):
            filled[i] = value
        return tree_unflatten(filled, spec)

    return tensors, rebuild


def _guard_batchnorms(segment: nn.Module) -> None:
    for module in segment.modules():
        if module is segment:
            continue  # guarded inside its own checkpointed forward
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and not getattr(module, "_monet_guarded", False):
            module.register_forward_pre_hook(_bn_pre_hook)
            # always_call: checkpoint stops a recompute by raising from inside the
            # BatchNorm (after its last saved tensor); the restore must still run.
            module.register_forward_hook(_bn_post_hook, always_call=True)
            module._monet_guarded = True


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _bn_pre_hook(module: nn.Module, args: Any) -> None:
    # A forward call during backward is a recompute: freeze the running statistics
    # (momentum 0 keeps them) and remember the batch counter to restore it after.
    if not (module.training and _in_backward()):
        return
    from torch.utils._python_dispatch import _disable_current_modes

    with torch.no_grad(), _disable_current_modes():
        counter = None if module.num_batches_tracked is None else module.num_batches_tracked.clone()
    module._monet_saved = (module.momentum, counter)
    module.momentum = 0.0


def _bn_post_hook(module: nn.Module, args: Any, output: Any) -> None:
    saved = getattr(module, "_monet_saved", None)
    if saved is None:
        return
    from torch.utils._python_dispatch import _disable_current_modes

    momentum, counter = saved
    module.momentum = momentum
    if counter is not None:
        with torch.no_grad(), _disable_current_modes():
            module.num_batches_tracked.copy_(counter)
    module._monet_saved = None
