"""Apply a schedule to a model: checkpointed segments with a per-op keep policy, and
operator variants and offloads outside them.

Each scheduled module's ``forward`` runs under non-reentrant ``torch.utils.checkpoint``
(``preserve_rng_state=True``, so dropout draws the same mask on recompute) with a
selective-checkpointing policy that keeps exactly the ops the schedule marks ``keep``,
keyed by (aten overload, occurrence within the segment). A chain of sibling calls runs
under one checkpoint frame that opens in its first member's forward and closes at the end
of its last one's (``_Chain``). BatchNorm layers inside a segment are guarded so a
recompute does not update their running statistics again. On the first forward the op
sequence is fingerprinted and checked against the schedule.
"""

from __future__ import annotations

import functools
import warnings
import weakref
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

from monet_cli.core.allocator import same_counting
from monet_cli.core.schedule import Schedule, load_schedule
from monet_cli.errors import FingerprintError
from monet_cli.runtime.fingerprint import FirstForwardCheck, warn_if_untested_torch
from monet_cli.runtime.frames import abandon_frame, close_frame, open_frame
from monet_cli.runtime.guards import install_guards, install_output_check, refuse_existing_checkpointing
from monet_cli.runtime.meter import MachineryMarker, alloc_conf
from monet_cli.runtime.offload import install_offloads
from monet_cli.runtime.ranges import RangeSegment
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
    _warn_if_other_allocator(schedule)
    refuse_existing_checkpointing(model)
    install_guards(model, schedule.fingerprint, schedule.model, check_hooks=check_fingerprint)
    if turn_off_kv_cache(model):
        warnings.warn(
            "monet: set model.config.use_cache = False for training, as transformers' own gradient "
            "checkpointing does: a recompute would fill the key/value cache twice",
            stacklevel=3,
        )
    if schedule.model.out_of_place_activations:
        make_out_of_place(model)
    modules = dict(model.named_modules())
    marker = MachineryMarker()
    # Op ranges first: a module segment around a range's module then checkpoints the range's
    # forward (and its recompute runs the range again, nested). Chains last: they keep their
    # members' forwards, checkpointed ones included.
    for segment in sorted(schedule.segments, key=lambda s: (bool(s.chain), s.within is None)):
        members = [_module(modules, path) for path in segment.members]
        keep = frozenset((k.op, k.occurrence) for k in schedule.kept_in(segment.module))
        if segment.within is not None:
            RangeSegment(segment, members[0], members[1:], marker).install()
            for member in members[1:]:
                guard_batchnorms(member, itself=True)
        elif segment.chain:
            _Chain(segment.module, members, segment.chain, _context_fn(keep), marker).install()
            for member in members:
                guard_batchnorms(member, itself=True)
        else:
            members[0].forward = checkpointed_forward(members[0], keep, marker)
            guard_batchnorms(members[0])
    install_variants(model, schedule.variants, marker)
    install_offloads([_module(modules, o.module) for o in schedule.offloads], schedule.offloads, marker)
    if check_fingerprint:
        FirstForwardCheck(model, schedule.fingerprint, marker).install()
    install_output_check(model, schedule.fingerprint)
    setattr(model, _APPLIED, schedule)
    setattr(model, _MACHINERY, marker)
    return model


def _warn_if_other_allocator(schedule: Schedule) -> None:
    """A CUDA schedule applied where the allocator counts blocks otherwise than where it was
    predicted runs, with a warning: its peak may differ from the prediction."""
    if schedule.fingerprint.device_type != "cuda":
        return
    expected, found = schedule.predicted.alloc_conf, alloc_conf()
    if not same_counting(expected, found):
        warnings.warn(
            f"monet: this schedule's peak was predicted with PYTORCH_CUDA_ALLOC_CONF '{expected}' (its "
            f"profile's); this process has '{found}', whose allocator counts blocks otherwise: the peak "
            "may differ from the prediction",
            stacklevel=3,
        )


def _module(modules: dict[str, nn.Module], path: str) -> nn.Module:
    module = modules.get(path)
    if module is None:
        raise FingerprintError(
            f"schedule segment module '{path}' is not a module of this model (the schedule was made for another model)"
        )
    return module


def applied_schedule(model: nn.Module) -> Schedule | None:
    return getattr(model, _APPLIED, None)


def machinery(model: nn.Module) -> MachineryMarker | None:
    """The flag that is up while checkpoint's own bookkeeping runs in ``model``'s segments."""
    return getattr(model, _MACHINERY, None)


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


def _context_fn(keep: frozenset[tuple[str, int]]) -> Callable[[], Any]:
    # Keeping nothing is plain checkpointing: skip the selective policy's dispatch modes,
    # which cost Python time on every op of the segment, in forward and in recompute.
    return _keep_policy(keep) if keep else noop_context_fn


def checkpointed_forward(
    module: nn.Module, keep: frozenset[tuple[str, int]], marker: MachineryMarker, *, selective: bool = False
) -> Callable[..., Any]:
    """The forward ``apply_schedule`` gives a module segment that keeps ``keep``: ``module``'s
    current forward under checkpoint. ``selective`` runs the keep policy even when it keeps
    nothing (``monet profile`` prices the policy with it)."""
    original = module.forward
    context_fn = _keep_policy(keep) if selective else _context_fn(keep)

    # Recompute calls ``original`` directly, not through ``module(...)``, so a BatchNorm
    # that is itself the segment gets its guard here rather than from module hooks.
    guard_self = isinstance(module, nn.modules.batchnorm._BatchNorm)

    def run_original(*args: Any, **kwargs: Any) -> Any:
        with marker.lowered():
            if guard_self:
                _bn_pre_hook(module, args)
            try:
                return original(*args, **kwargs)
            finally:
                if guard_self:
                    _bn_post_hook(module, args, None)

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
                run_rebuilt,
                *tensors,
                use_reentrant=False,
                preserve_rng_state=True,
                context_fn=context_fn,
                determinism_check="default",
            )

    return checkpointed


def _tensors_apart(args: tuple, kwargs: dict) -> tuple[list[torch.Tensor], Callable[[tuple], tuple[tuple, dict]]]:
    """Every tensor argument, positional or not, and how to put the call back together.

    checkpoint saves its positional tensors through autograd's saved-tensor hooks, so a
    segment nested in another one lets the outer segment drop and recompute them; tensors
    in keyword arguments or containers it would hold strongly. The rebuild closes over the
    arguments with their tensors taken out, so it holds none of them either. A tensor passed
    at several places is handed over once and put back at each: the recompute sees the
    forward's aliasing (self-attention given one tensor as query, key and value takes another
    path, saving other tensors, than given three)."""
    leaves, spec = tree_flatten((args, kwargs))
    tensors: list[torch.Tensor] = []
    first: dict[int, int] = {}
    """``id`` of each tensor -> its place in ``tensors``."""
    slots: dict[int, int] = {}
    """Leaf position -> the place in ``tensors`` of the tensor there."""
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            slots[i] = first.setdefault(id(leaf), len(tensors))
            if slots[i] == len(tensors):
                tensors.append(leaf)
            leaves[i] = None

    def rebuild(values: tuple) -> tuple[tuple, dict]:
        filled = list(leaves)
        for i, k in slots.items():
            filled[i] = values[k]
        return tree_unflatten(filled, spec)

    return tensors, rebuild


class _Chain:
    """A segment over sibling calls (``core.segments.sibling_chains``): checkpoint's frame
    opens in the first member's forward and closes at the end of the last member's, so the
    parent's own code runs unchanged between them, on the real tensors. Its recompute runs
    the members one after another from the first one's arguments, as the profile showed the
    parent doing. Each member must be called in order with the previous one's output; any
    other call raises instead of checkpointing something else."""

    def __init__(
        self,
        name: str,
        members: list[nn.Module],
        paths: tuple[str, ...],
        context_fn: Callable[[], Any],
        marker: MachineryMarker,
    ) -> None:
        self.name = name
        self.members = members
        self.paths = paths
        self.context_fn = context_fn
        self.marker = marker
        self.forwards = [member.forward for member in members]
        self.frame: Any = None
        """The open checkpoint generator, between the first member's call and the last one's end."""
        self.expected = 0
        self.handed: weakref.ref | None = None
        """The last member's output, which the next member must be called with."""
        self.replaying = 0

    def install(self) -> None:
        for k, member in enumerate(self.members):
            member.forward = functools.wraps(self.forwards[k])(functools.partial(self._forward, k))

    def _forward(self, k: int, *args: Any, **kwargs: Any) -> Any:
        if self.replaying:  # the chain's own recompute calls each member
            return self.forwards[k](*args, **kwargs)
        if k == 0:
            # A frame still open here belongs to a forward that raised between two members
            # (members are called once per forward): leave it before starting anew.
            self._close()
            if not torch.is_grad_enabled():
                return self.forwards[0](*args, **kwargs)  # eval / no_grad: nothing to save
            self._open(args, kwargs)
        elif self.frame is None:
            return self.forwards[k](*args, **kwargs)  # the chain is not running (no grad)
        else:
            self._check_handoff(k, args, kwargs)
        try:
            output = self.forwards[k](*args, **kwargs)
        except BaseException:
            self._close()
            raise
        if k == len(self.members) - 1:
            self._finish()
        else:
            self.expected = k + 1
            self.handed = weakref.ref(output) if isinstance(output, torch.Tensor) else None
        return output

    def _open(self, args: tuple, kwargs: dict) -> None:
        tensors, rebuild = _tensors_apart(args, kwargs)

        def recompute(*values: torch.Tensor) -> None:
            call_args, call_kwargs = rebuild(values)
            self.replaying += 1
            try:
                with self.marker.lowered():
                    output = self.members[0](*call_args, **call_kwargs)
                    for member in self.members[1:]:
                        output = member(output)
            finally:
                self.replaying -= 1

        self.frame = open_frame(recompute, self.context_fn, self.marker, *tensors)

    def _check_handoff(self, k: int, args: tuple, kwargs: dict) -> None:
        handed = self.handed() if self.handed is not None else None
        if k != self.expected or kwargs or len(args) != 1 or handed is None or args[0] is not handed:
            self._fail(f"'{self.paths[k]}' was not called right after '{self.paths[k - 1]}' with its output alone")

    def _finish(self) -> None:
        frame, self.frame, self.handed = self.frame, None, None
        close_frame(frame, self.marker)

    def _close(self) -> None:
        frame, self.frame, self.handed = self.frame, None, None
        if frame is not None:
            abandon_frame(frame, self.marker)

    def _fail(self, what: str) -> None:
        self._close()
        raise FingerprintError(
            f"schedule segment '{self.name}' does not match this model: {what}, as the profiled forward did"
        )


def guard_batchnorms(segment: nn.Module, *, itself: bool = False) -> Callable[[], None]:
    """Guard the BatchNorms in ``segment``; the segment itself only when ``itself`` (a module
    segment that is a BatchNorm guards itself in its checkpointed forward). Returns what
    removes the guards it added."""
    handles = []
    for module in segment.modules():
        if module is segment and not itself:
            continue
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and not getattr(module, "_monet_guarded", False):
            handles.append((module, module.register_forward_pre_hook(_bn_pre_hook)))
            # always_call: checkpoint stops a recompute by raising from inside the
            # BatchNorm (after its last saved tensor); the restore must still run. prepend: an
            # op range's hook that ends the call runs after it, so the range's recorder does
            # not take the restore for the model's own code.
            handles.append((module, module.register_forward_hook(_bn_post_hook, always_call=True, prepend=True)))
            module._monet_guarded = True

    def remove() -> None:
        for module, handle in handles:
            handle.remove()
            module.__dict__.pop("_monet_guarded", None)

    return remove


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _bn_pre_hook(module: nn.Module, args: Any) -> None:
    # A forward call during backward is a recompute: freeze the running statistics
    # (momentum 0 keeps them) and remember the batch counter to restore it after.
    if not (module.training and _in_backward()) or getattr(module, "_monet_saved", None) is not None:
        return  # not a recompute, or frozen already (a BatchNorm segment inside a chain guards twice)
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
