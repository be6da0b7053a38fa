"""Rehearse checkpoint's recompute of every candidate module call, once, while profiling.

Non-reentrant checkpoint recomputes a segment by calling its ``forward`` again during
backward, with the arguments of the first call, the RNG state restored and autocast as it
was. That re-run must repeat the first one exactly: selective checkpointing finds kept
values by (op, occurrence), checkpoint checks the saved tensors' shapes, and backward
uses the recomputed values. A forward that changes state it also reads breaks this: a
key/value cache grows on every call (the re-run attends over twice the tokens, runs other
ops, crashes with "not found in storage" or "different metadata", or keeps the grown cache
alive through backward), a counter or a memoised tensor changes what runs.

So, in one extra step, each candidate call records its arguments, RNG and autocast state,
the ops it runs and its outputs; after the loss each call is run again in reverse order
(as backward meets them) under those conditions, and every call whose re-run differs in
ops, shapes or values is reported with the reason. The profile marks those calls, and the
solver never offers them.

A re-run must also leave nothing behind: a forward hook that collects features (distillation,
perceptual losses, timm's feature hooks) runs again in a recompute, on the recomputed
tensors, and holds them past the step's peak where the simulator frees them (a 4-block model
measured 11% over its predicted peak). So each re-run counts the storages it makes that are
still alive once its output is dropped, and a call that leaves any is not offered either.
The call's own hooks are rehearsed apart: checkpoint re-runs a segment's forward without them,
but a chain's or an op range's recompute calls the module, hooks and all
(``ModuleCall.hooks_reason``).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.modules.module import _global_forward_hooks, _global_forward_pre_hooks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from monet_cli.runtime.fingerprint import IGNORED_OPS, signature
from monet_cli.runtime.meter import LiveStorageMeter, storage_key
from monet_cli.workload.step import Workload

RTOL, ATOL = 1e-5, 1e-6
"""Re-run outputs must match this closely (exactly on CPU in practice; GPU kernels may use atomics)."""


@dataclass(frozen=True, kw_only=True)
class Rehearsed:
    differs: dict[str, str] = field(default_factory=dict)
    """Module path -> why re-running its forward does not repeat it (or leaves tensors behind)."""
    hooks_differ: dict[str, str] = field(default_factory=dict)
    """Module path -> why its own hooks cannot run again (``ModuleCall.hooks_reason``)."""


@dataclass
class _Take:
    """One candidate call as the forward ran it."""

    module: torch.nn.Module
    forward: Any
    args: tuple
    kwargs: dict
    rng: tuple[torch.Tensor, torch.Tensor | None]
    autocast: tuple[bool, torch.dtype, bool]
    ops: list[str]
    output: Any
    versions: list[int]
    """Version counters of the output's tensors when the call returned."""


class _OpLog(TorchDispatchMode):
    """Appends ``overload|argument shapes`` of every op to whichever list is current."""

    def __init__(self) -> None:
        super().__init__()
        self.sink: list[str] | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.sink is not None and str(func) not in IGNORED_OPS:
            tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            self.sink.append(f"{func}|{signature(tensors)}")
        return func(*args, **kwargs)


class _Made(LiveStorageMeter):
    """Counts the storages a re-run makes (not those of its inputs, written or viewed) that
    are alive."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {storage_key(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and storage_key(tensor) not in inputs:
                self.track(tensor, kind="activation", producer=None)
        return out

    def left_bytes(self) -> int:
        """Bytes still alive; a reference cycle is collected before it counts."""
        if self.current_bytes:
            gc.collect()
        return self.current_bytes


class Rehearsal:
    def __init__(self, workload: Workload, fqns: list[str]) -> None:
        self.workload = workload
        modules = dict(workload.model.named_modules())
        self.modules = {fqn: modules[fqn] for fqn in fqns if fqn in modules}
        self.log = _OpLog()
        self.takes: dict[str, _Take] = {}
        self.recording = False

    def run(self) -> Rehearsed:
        """One step's forward and loss, then every re-run."""
        w = self.workload
        originals = {fqn: module.forward for fqn, module in self.modules.items()}
        own = {fqn for fqn, module in self.modules.items() if "forward" in module.__dict__}
        for fqn, module in self.modules.items():
            module.forward = self._recording_forward(fqn, originals[fqn])
        try:
            w.zero_grad()
            self.log.sink = []
            self.recording = True
            with self.log:
                loss = w.forward_loss()
            self.recording = False
            del loss
            return self._rehearse_all()
        finally:
            for fqn, module in self.modules.items():
                if fqn in own:
                    module.forward = originals[fqn]
                else:
                    del module.forward  # back to the class's forward
            self.takes.clear()
            self.log.sink = None

    def _recording_forward(self, fqn: str, original: Any) -> Any:
        device = self.workload.device

        def forward(*args: Any, **kwargs: Any) -> Any:
            if not self.recording:
                return original(*args, **kwargs)
            rng = (torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None)
            autocast = (
                torch.is_autocast_enabled(device.type),
                torch.get_autocast_dtype(device.type),
                torch.is_autocast_cache_enabled(),
            )
            sink = self.log.sink
            start = len(sink)
            output = original(*args, **kwargs)
            self.takes[fqn] = _Take(
                module=self.modules[fqn],
                forward=original,
                args=args,
                kwargs=kwargs,
                rng=rng,
                autocast=autocast,
                ops=sink[start:],
                output=output,
                versions=[t._version for t in _tensors(output)],
            )
            return output

        return forward

    def _rehearse_all(self) -> Rehearsed:
        buffers = [b for b in self.workload.model.buffers()]
        saved = [b.detach().clone() for b in buffers]
        rehearsed = Rehearsed()
        for fqn in reversed(list(self.takes)):
            take = self.takes[fqn]
            problem = self._rehearse(take)
            if problem is not None:
                rehearsed.differs[fqn] = problem
            if _has_hooks(take.module):
                hooks_problem = self._rehearse_hooks(take)
                if hooks_problem is not None:
                    rehearsed.hooks_differ[fqn] = hooks_problem
            with torch.no_grad():  # BatchNorm statistics: monet's guard keeps them during a real recompute
                for buffer, value in zip(buffers, saved):
                    buffer.copy_(value)
        return rehearsed

    @contextmanager
    def _as_recorded(self, take: _Take) -> Iterator[None]:
        """The RNG, grad and autocast state the call ran under."""
        device = self.workload.device
        enabled, dtype, cache = take.autocast
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, device_type=device.type), torch.enable_grad():
            torch.set_rng_state(take.rng[0])
            if take.rng[1] is not None:
                torch.cuda.set_rng_state(take.rng[1], device)
            with torch.autocast(device.type, dtype=dtype, enabled=enabled, cache_enabled=cache):
                yield

    def _rehearse(self, take: _Take) -> str | None:
        ops: list[str] = []
        made = _Made(self.workload.device.type)
        try:
            with self._as_recorded(take):
                self.log.sink = ops
                with self.log, made:
                    output = take.forward(*take.args, **take.kwargs)
        except Exception as err:  # the model's own code: report it, never crash the profile
            return f"re-running its forward raised {type(err).__name__}: {str(err).strip().splitlines()[0][:120]}"
        finally:
            self.log.sink = None
        problem = _ops_problem(take.ops, ops) or _output_problem(take, output)
        del output
        left = made.left_bytes()
        if problem is None and left:
            problem = (
                f"re-running its forward leaves {left} bytes alive after its output is dropped: "
                "a forward hook or the module itself stores what it makes, which a recompute would hold"
            )
        return problem

    def _rehearse_hooks(self, take: _Take) -> str | None:
        """Why a re-run with the module's own hooks run around it does not repeat it: what
        it leaves alive (the hooks' results are dropped: only what they keep is asked)."""
        module = take.module
        made = _Made(self.workload.device.type)
        try:
            with self._as_recorded(take), made:
                _run_pre_hooks(module, take.args, take.kwargs)
                output = take.forward(*take.args, **take.kwargs)
                _run_hooks(module, take.args, take.kwargs, output)
                del output
        except Exception as err:  # the model's own hooks: report it, never crash the profile
            return f"re-running it with its hooks raised {type(err).__name__}: {str(err).strip().splitlines()[0][:120]}"
        left = made.left_bytes()
        if left:
            return f"its forward hooks, run again, leave {left} bytes alive: they store what the call makes"
        return None


def _has_hooks(module: torch.nn.Module) -> bool:
    return bool(
        module._forward_hooks or module._forward_pre_hooks or _global_forward_hooks or _global_forward_pre_hooks
    )


def _run_pre_hooks(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    for key, hook in (*_global_forward_pre_hooks.items(), *module._forward_pre_hooks.items()):
        if key in module._forward_pre_hooks_with_kwargs:
            hook(module, args, kwargs)
        else:
            hook(module, args)


def _run_hooks(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    for key, hook in (*_global_forward_hooks.items(), *module._forward_hooks.items()):
        if key in module._forward_hooks_with_kwargs:
            hook(module, args, kwargs, output)
        else:
            hook(module, args, output)


def _ops_problem(first: list[str], again: list[str]) -> str | None:
    if first == again:
        return None
    for k, (a, b) in enumerate(zip(first, again)):
        if a != b:
            return (
                f"re-running its forward runs other ops (op {k}: {_short(b)} instead of {_short(a)}): "
                "it changes state it reads, e.g. a key/value cache (use_cache=False)"
            )
    return (
        f"re-running its forward runs {len(again)} ops instead of {len(first)}: "
        "it changes state it reads, e.g. a key/value cache (use_cache=False)"
    )


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _output_problem(take: _Take, again: Any) -> str | None:
    a, b = _tensors(take.output), _tensors(again)
    if len(a) != len(b):
        return f"re-running its forward returns {len(b)} tensors instead of {len(a)}"
    for x, y, version in zip(a, b, take.versions):
        if x.shape != y.shape or x.dtype != y.dtype:
            return f"re-running its forward returns {tuple(y.shape)} {y.dtype} instead of {tuple(x.shape)} {x.dtype}"
        if x._version != version:
            continue  # written in place after the call (ResNet's ``out += identity``): its values moved on
        same = (
            torch.allclose(x, y, rtol=RTOL, atol=ATOL, equal_nan=True) if x.is_floating_point() else torch.equal(x, y)
        )
        if not same:
            return "re-running its forward gives other values: it depends on state that changed after it ran"
    return None


def _short(op: str) -> str:
    name, _, shapes = op.partition("|")
    return f"{name}({shapes[:60]})"
