"""Checks on every training forward of a scheduled model.

A schedule's prediction holds for the step its profile measured: one training forward of
the profiled model (its hooks, no checkpointing of its own, a batch without padding), then
that forward's backward. A training loop can leave that step at any step, not only the
first, so each check runs on every training forward and refuses with one line (exit 5):

- checkpointing switched on (trainers switch it on after the model is built);
- a padded batch, where the profile's was not;
- a forward hook the profile did not see, registered before or after the first step;
- a second training forward while the previous one still waits for its backward;
- an output holding more tensor bytes than the profiled forward's (hidden states or attention
  weights asked for): a loop holding it keeps tensors a schedule drops.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle

from monet_cli.core.profile import Fingerprint, ModelSpec
from monet_cli.errors import CheckpointConflictError, FingerprintError
from monet_cli.runtime.fingerprint import hooks_problem
from monet_cli.runtime.meter import storage_key


def install_guards(
    model: nn.Module, fingerprint: Fingerprint, spec: ModelSpec, *, check_hooks: bool
) -> list[RemovableHandle]:
    """Register the per-forward checks on ``model``'s root (the hook check only when
    ``check_hooks``) and return their handles. ``monet profile`` times them in the model's
    step (``profiler/in_step.py``, ``Overheads.checks_ms``) and removes them after."""
    handles = [model.register_forward_pre_hook(_refuse_on_training_forward)]
    if _profiled_unpadded(spec):
        handles.append(model.register_forward_pre_hook(_refuse_padded_batches, with_kwargs=True))
    # A profile made before hooks were listed has None: no hook check.
    handles += _LoopGuard(fingerprint.hooks if check_hooks else None).install(model)
    return handles


def install_output_check(model: nn.Module, fingerprint: Fingerprint) -> list[RemovableHandle]:
    """Refuse a training forward whose output holds more tensor bytes than the profiled one's.
    Registered after the first forward's fingerprint check, whose reason (another batch shape,
    other ops) says more; a profile made before the output's bytes were recorded: no check."""
    if fingerprint.output_bytes is None:
        return []
    return [model.register_forward_hook(functools.partial(_check_output, fingerprint.output_bytes))]


def _check_output(profiled: int, model: nn.Module, args: Any, output: Any) -> None:
    if not _training(model):
        return
    held = output_bytes(output)
    if held > profiled:
        raise FingerprintError(
            f"schedule does not match this training forward: its output holds {held:,} bytes of tensors where "
            f"the profiled forward's held {profiled:,} (hidden states or attention weights asked for, a larger "
            "batch?), and a loop holding the output keeps what the schedule frees: drop "
            "output_hidden_states/output_attentions, or profile the model called the same way"
        )


def _training(model: nn.Module) -> bool:
    return model.training and torch.is_grad_enabled()


def existing_checkpointing(model: nn.Module) -> str | None:
    """Where the model already checkpoints activations itself, in words (None: nowhere)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    # This runs on every training forward: a walk over the modules' own dicts, naming only the
    # module it finds, took 65 us on resnet50 against 152 through named_modules(), which builds
    # every module's path (12-07). Both libraries set their flag as a plain attribute, which the
    # dict has without getattr's AttributeError inside nn.Module.__getattr__.
    unvisited: list[nn.Module | None] = [model]
    while unvisited:
        module = unvisited.pop()
        if module is None:  # register_module(name, None)
            continue
        flags = module.__dict__
        if flags.get("gradient_checkpointing") is True:
            return (
                f"{_where(model, module)} has Hugging Face gradient checkpointing on: turn it off "
                "(model.gradient_checkpointing_disable(), or leave gradient_checkpointing out of TrainingArguments)"
            )
        if flags.get("grad_checkpointing") is True:
            return (
                f"{_where(model, module)} has timm gradient checkpointing on: call model.set_grad_checkpointing(False)"
            )
        if isinstance(module, CheckpointWrapper):
            return (
                f"{_where(model, module)} is wrapped by torch's checkpoint_wrapper (apply_activation_checkpointing): "
                "remove it"
            )
        unvisited.extend(flags["_modules"].values())
    return None


def _where(model: nn.Module, module: nn.Module) -> str:
    name = next(name for name, candidate in model.named_modules() if candidate is module)
    return f"'{name}'" if name else "the model"


def refuse_existing_checkpointing(model: nn.Module) -> None:
    problem = existing_checkpointing(model)
    if problem is not None:
        raise CheckpointConflictError(f"monet's schedule decides what is recomputed, but {problem}")


def _refuse_on_training_forward(model: nn.Module, args: Any) -> None:
    if _training(model):
        refuse_existing_checkpointing(model)


def _profiled_unpadded(spec: ModelSpec) -> bool:
    """Whether the profile fed an ``attention_mask`` of ones (monet's language-model inputs)."""
    return any(i.name == "attention_mask" and i.low == 1 for i in spec.inputs)


def _refuse_padded_batches(model: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
    # transformers builds a [batch, 1, tokens, tokens] attention mask only for a padded batch:
    # other ops than the profile's, and memory the prediction lacks. One small reduction a step.
    mask = kwargs.get("attention_mask")
    if _training(model) and isinstance(mask, torch.Tensor) and not bool(mask.all()):
        raise FingerprintError(
            "schedule does not match this batch: it pads (its attention_mask has zeros), where the profile's batch "
            "did not, and a padded batch runs other ops (a [batch, 1, tokens, tokens] attention mask) whose memory "
            "the prediction lacks: train on batches without padding, packing sequences to the profile's length"
        )


class _Waiting:
    """Put in the metadata of a training forward's output nodes: it lives as long as the
    graph, so a weak reference to it says whether the graph (and what it saved) is alive."""


class _LoopGuard:
    """What a training loop may do between two training forwards that the profile did not
    measure: register a forward hook (refused when the profile did not see it; ``profiled_hooks``
    None skips the check), or start the next forward while the previous one's graph is alive
    and its backward has not reached it. Two forwards' saved tensors (two views of a batch, a
    discriminator on real and fake samples, then one backward) are alive together where the
    profile measured one forward's. A forward whose output is dropped unused frees its graph
    and passes, as does gradient accumulation (a backward after each forward)."""

    def __init__(self, profiled_hooks: tuple[str, ...] | None) -> None:
        self.profiled_hooks = profiled_hooks
        self.hooks_seen_at: int | None = None
        """``RemovableHandle.next_id`` when the model's hooks last matched the profile's. Every
        hook registered anywhere takes the next id, so while it stands no hook is new and the
        forward skips the comparison (a pass over every module's hooks)."""
        self.waiting: weakref.ref[_Waiting] | None = None
        """The last training forward's graph, until backward reaches it."""

    def install(self, model: nn.Module) -> list[RemovableHandle]:
        return [model.register_forward_pre_hook(self._starts), model.register_forward_hook(self._ends)]

    def _starts(self, model: nn.Module, args: Any) -> None:
        if not _training(model):
            return
        if self.profiled_hooks is not None and RemovableHandle.next_id != self.hooks_seen_at:
            problem = hooks_problem(self.profiled_hooks, model)
            if problem:
                raise FingerprintError(f"schedule does not match this model: {problem}")
            self.hooks_seen_at = RemovableHandle.next_id
        if self.waiting is not None and self.waiting() is not None:
            raise FingerprintError(
                "schedule does not match this training loop: a training forward started while the previous one's "
                "graph still waits for its backward, so both forwards' saved tensors are alive where the profile "
                "measured one: run backward after each forward (or put both inputs in one batch, profiled at that size)"
            )

    def _ends(self, model: nn.Module, args: Any, output: Any) -> None:
        if not _training(model):
            return
        before = RemovableHandle.next_id
        nodes = {id(t.grad_fn): t.grad_fn for t in tree_flatten(output)[0] if _has_graph(t)}
        marker = _Waiting()
        for node in nodes.values():
            node.metadata[_Waiting] = marker
            node.register_prehook(self._reached)
        self.waiting = weakref.ref(marker) if nodes else None
        if self.hooks_seen_at == before:  # the handles just taken are the guard's own, no new hook
            self.hooks_seen_at = RemovableHandle.next_id

    def _reached(self, grad_outputs: Any) -> None:
        self.waiting = None


def output_bytes(output: Any) -> int:
    """Bytes of the distinct storages of the tensors in a forward's output."""
    storages = {
        storage_key(leaf): leaf.untyped_storage().nbytes()
        for leaf in tree_flatten(output)[0]
        if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta"
    }
    return sum(storages.values())


def _has_graph(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.grad_fn is not None
