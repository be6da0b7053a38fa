"""Measure the memory of a training step.

CPU: count the bytes of live tensor storages. A dispatch mode sees every op's outputs;
each new ``UntypedStorage`` adds its ``nbytes()`` and gets a weakref finalizer that
subtracts them when PyTorch frees it. PyTorch keeps one Python object per storage, so
views count once and the total is exact and deterministic (it equals
``torch.distributed._tools.mem_tracker.MemTracker``). Storages that exist before the
step (parameters, buffers, inputs, optimizer state) are registered up front.

CUDA: the caching allocator's own peak, ``torch.cuda.max_memory_allocated`` after a
reset. That call returns 0 without a GPU, so it is only used when CUDA is in use. The
profiler's recorder, a live-storage meter, counts a CUDA storage at the allocator's block
size (``core.allocator``), so that the profile adds up what the allocator counts.
"""

from __future__ import annotations

import gc
import os
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from monet_cli.core.allocator import cuda_block_bytes, roundup_divisions
from monet_cli.errors import UsageError

if TYPE_CHECKING:
    from monet_cli.workload.step import Workload


def storage_key(tensor: torch.Tensor) -> int:
    """Identity of the memory behind a tensor (shared by all its views)."""
    return tensor.untyped_storage()._cdata


def alloc_conf() -> str:
    """The CUDA caching allocator's settings in this process, from both variables PyTorch reads."""
    return ",".join(filter(None, (os.environ.get(name) for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))))


def allocator_divisions() -> int:
    """The CUDA allocator's ``roundup_power2_divisions`` setting in this process (0: not set)."""
    try:
        return roundup_divisions(alloc_conf())
    except ValueError as err:
        raise UsageError(str(err)) from None


def _release_if_alive(meter: weakref.ref[LiveStorageMeter], key: int) -> None:
    alive = meter()
    if alive is not None:
        alive._release(key)


class LiveStorageMeter(TorchDispatchMode):
    """Dispatch mode that tracks the bytes of every live tensor storage."""

    def __init__(self, device_type: str = "cpu") -> None:
        super().__init__()
        self.device_type = device_type
        """The device whose memory is counted: a storage elsewhere counts 0 bytes (a CUDA
        step's host scalars, such as attention's dropout seed and offset)."""
        self.current_bytes = 0
        self.peak_bytes = 0
        self.interrupted = False
        self._sizes: dict[int, int] = {}
        self._divisions: int | None = None
        """The allocator's rounding setting, read at the first CUDA storage."""

    # -- registration -------------------------------------------------------------
    def register(self, tensors: Iterable[torch.Tensor], kind: str = "other") -> None:
        """Count storages that already exist when measuring starts."""
        self.track_resident((tensor, kind) for tensor in tensors)

    def track_resident(self, resident: Iterable[tuple[torch.Tensor, str]]) -> None:
        """Count what a workload keeps between steps (``Workload.resident_tensors``). Pass the
        generator itself: a list, or a loop variable in the caller, would keep the last step's
        output alive after the step's forward frees it."""
        for tensor, kind in resident:
            self.track(tensor, kind=kind, producer=None)

    def track(self, tensor: torch.Tensor, *, kind: str, producer: int | None) -> int | None:
        """Start counting ``tensor``'s storage; returns its key if it was new."""
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            return None
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._sizes:
            return None
        nbytes = storage.nbytes()
        if tensor.device.type != self.device_type:
            nbytes = 0
        elif tensor.device.type == "cuda":
            if self._divisions is None:
                self._divisions = allocator_divisions()
            nbytes = cuda_block_bytes(nbytes, roundup_power2_divisions=self._divisions)
        self._sizes[key] = nbytes
        # The finalizer must not hold the meter: a meter holding a model (the profiler's
        # recorder) would otherwise stay alive, model and all, as long as a parameter's
        # storage does, and that storage as long as the model: for the rest of the process.
        weakref.finalize(storage, _release_if_alive, weakref.ref(self), key)
        self.current_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        self.on_alloc(key, nbytes, kind, producer)
        return key

    def is_tracked(self, tensor: torch.Tensor) -> bool:
        if tensor.device.type == "meta":
            return True
        return storage_key(tensor) in self._sizes

    def _release(self, key: int) -> None:
        try:
            nbytes = self._sizes.pop(key, None)
            if nbytes is None:
                return
            self.current_bytes -= nbytes
            self.on_free(key)
        except KeyboardInterrupt:
            # Python ignores exceptions raised in finalizers: a Ctrl-C landing here would be
            # lost and the step would run on. Raise it again at the next op instead.
            self.interrupted = True

    def raise_deferred_interrupt(self) -> None:
        """Called at every op: delivers a Ctrl-C that arrived while a storage was being freed."""
        if self.interrupted:
            self.interrupted = False
            raise KeyboardInterrupt

    # -- extension points for the profiler's recorder -----------------------------
    def on_alloc(self, key: int, nbytes: int, kind: str, producer: int | None) -> None:
        """Called for each new storage."""

    def on_free(self, key: int) -> None:
        """Called when a tracked storage is freed."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.raise_deferred_interrupt()
        kwargs = kwargs or {}
        self.track_unseen_inputs((args, kwargs))
        out = func(*args, **kwargs)
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                self.track(tensor, kind="activation", producer=None)
        return out

    def track_unseen_inputs(self, args: object) -> None:
        """Tensors made outside the dispatcher (``torch.tensor(...)``) still take memory."""
        for tensor in tree_flatten(args)[0]:
            if isinstance(tensor, torch.Tensor) and not self.is_tracked(tensor):
                self.track(tensor, kind="other", producer=None)


class MachineryMarker:
    """Up while bookkeeping that is not the model's own computation runs: checkpoint's frames
    in a segment, an operator variant's narrowing. The fingerprint check and the timeline skip
    its ops; the memory meter counts them. ``with marker:`` raises it for a block."""

    def __init__(self) -> None:
        self.depth = 0

    @property
    def active(self) -> bool:
        return self.depth > 0

    def __enter__(self) -> None:
        self.depth += 1

    def __exit__(self, *exc: object) -> None:
        self.depth -= 1

    @contextmanager
    def lowered(self) -> Iterator[None]:
        """Down for a block of the model's own ops that machinery runs (checkpoint's forward
        inside a segment's call, or its recompute during backward)."""
        outside, self.depth = self.depth, 0
        try:
            yield
        finally:
            self.depth = outside


class TimelineMeter(LiveStorageMeter):
    """A live-storage meter that also keeps the live bytes after every op.

    ``machinery`` (anything with an ``active`` flag) marks when checkpoint's own bookkeeping
    runs: its ops (torch 2.11 makes an empty tensor per frame) get no point, so the timeline
    is numbered like the profile's ops."""

    def __init__(self, machinery: Any = None) -> None:
        super().__init__()
        self.timeline: list[int] = []
        self.machinery = machinery

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from monet_cli.runtime.fingerprint import IGNORED_OPS

        out = super().__torch_dispatch__(func, types, args, kwargs)
        if str(func) not in IGNORED_OPS and not (self.machinery is not None and self.machinery.active):
            self.timeline.append(self.current_bytes)
        return out


@dataclass(frozen=True, kw_only=True, slots=True)
class Measurement:
    peak_bytes: int
    meter: str
    timeline: tuple[int, ...] = ()
    """Live bytes after each op (CPU meter only, when asked for)."""


def cuda_allocated_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct CUDA storages behind ``tensors``, as the allocator counts them."""
    meter = LiveStorageMeter("cuda")
    meter.register(tensors)
    return meter.current_bytes


def free_unreachable(device: torch.device) -> None:
    """Before reading the CUDA allocator, which counts every live block of the process:
    collect unreachable cycles (a dropped model, say), so that only live tensors count."""
    gc.collect()
    torch.cuda.synchronize(device)


def measure_step(
    step: Callable[[], None],
    *,
    device: torch.device,
    preexisting: Iterable[tuple[torch.Tensor, str]],
    foreign: Iterable[torch.Tensor] = (),
    timeline: bool = False,
    machinery: Any = None,
) -> Measurement:
    """Run ``step`` once and return its peak memory with the device's meter.

    On CUDA the allocator counts every tensor of the process: ``foreign`` tensors (another
    model's parameters, gradients and optimizer state, kept alive beside this one) are
    subtracted. What the allocator holds that is no tensor (cuBLAS workspaces) stays in, as
    it does in the profile."""
    if device.type == "cuda":
        free_unreachable(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        peak = int(torch.cuda.max_memory_allocated(device)) - cuda_allocated_bytes(foreign)
        return Measurement(peak_bytes=peak, meter="cuda-allocator")
    meter = TimelineMeter(machinery) if timeline else LiveStorageMeter()
    meter.track_resident(preexisting)
    with meter:
        step()
    return Measurement(
        peak_bytes=meter.peak_bytes, meter="live-storages", timeline=tuple(meter.timeline) if timeline else ()
    )


def measure_peak(
    workload: Workload,
    seed: int | None = None,
    *,
    timeline: bool = False,
    beside: Workload | None = None,
    machinery: MachineryMarker | None = None,
) -> Measurement:
    """One step of ``workload`` (grads cleared first) under the device's memory meter;
    ``beside``: another workload alive on the same device, whose tensors are not this step's
    memory; ``machinery``: when checkpoint's bookkeeping runs (no timeline points)."""
    if workload.device.type == "cuda":
        _cache_of_own_step(workload)
    if seed is not None:
        torch.manual_seed(seed)
    workload.zero_grad()
    foreign = [] if beside is None else [t for t, _ in beside.resident_tensors()]
    return measure_step(
        workload.step,
        device=workload.device,
        preexisting=workload.resident_tensors(),
        foreign=foreign,
        timeline=timeline,
        machinery=machinery,
    )


def _cache_of_own_step(workload: Workload) -> None:
    """CUDA: which cached block a request gets, and so what the allocator counts, depends on
    the blocks earlier steps left in its cache. The measured step starts from the cache one
    step of its own workload leaves, as in training and as the simulator's replay assumes
    (``core.allocator``), not from another model's: ``apply`` measures the unmodified and the
    scheduled model in one process, and gpu-check profiles several models in one. This step is
    not seeded: the cache depends on the sizes asked for, which its inputs' values leave alone
    except in value-dependent models (routing), where its own optimizer update already makes
    the next step differ."""
    free_unreachable(workload.device)
    torch.cuda.empty_cache()
    workload.zero_grad()
    workload.step()
