"""Run a schedule's offloads (``monet_cli/core/offload.py``): saved tensors of a module call
held in host memory until backward needs them.

While an offloaded call's forward runs, saved-tensor hooks count the saves it makes. Each
save the schedule lists hands over its whole storage (once per storage, however many views
of it are saved): the storage is copied to pinned host memory on a side stream, and the
saved tensor becomes a handle. When the call returns, the compute stream waits for the
copies; the device storage then dies with Python's last reference. In backward the copies
come back on the side stream in the order the schedule expects backward to need them, one
ahead: the first when backward first unpacks any save of the call, each next one when the
one before it is first unpacked; an unpack waits for its own copy. A copy back is dropped
once every save of its storage has been unpacked (the nodes' own references then end with
the nodes).

The copies go through a ``HostStore``: ``PinnedHost`` on CUDA. A CPU has no other memory
to move to, so there is none there (tests bring their own store).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from monet_cli.core.schedule import OffloadDecision
from monet_cli.errors import DeviceError, FingerprintError
from monet_cli.runtime.meter import MachineryMarker


class HostStore(Protocol):
    def copy_out(self, data: torch.Tensor) -> Any:
        """Start copying ``data`` (bytes of a device storage) to host memory; return the copy."""

    def wait_out(self) -> None:
        """Make the compute stream wait for every copy out started so far."""

    def copy_in(self, host: Any, device: torch.device) -> tuple[torch.Tensor, Any]:
        """Start copying ``host`` back: a device byte tensor, and what ``wait_in`` waits for."""

    def wait_in(self, token: Any) -> None:
        """Make the compute stream wait for that copy back."""


class PinnedHost:
    """Pinned host buffers; copies both ways on a side stream, ordered after the compute
    stream's work queued before them (which may still read the memory a copy writes)."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device)

    def copy_out(self, data: torch.Tensor) -> torch.Tensor:
        host = torch.empty(data.numel(), dtype=torch.uint8, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(data.device))
        with torch.cuda.stream(self.stream):
            host.copy_(data, non_blocking=True)
        return host

    def wait_out(self) -> None:
        torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)

    def copy_in(self, host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.cuda.Event]:
        data = torch.empty(host.numel(), dtype=torch.uint8, device=device)  # allocated for the compute stream
        self.stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self.stream):
            data.copy_(host, non_blocking=True)
            arrived = torch.cuda.Event()
            arrived.record()
        return data, arrived

    def wait_in(self, token: torch.cuda.Event) -> None:
        torch.cuda.current_stream(self.stream.device).wait_event(token)


def storage_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """All of ``tensor``'s storage as a flat byte tensor sharing it."""
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage, 0, (storage.nbytes(),), (1,))


class _Copy:
    """One offloaded storage: its host copy, and its device copy while one is alive."""

    def __init__(self, store: HostStore, data: torch.Tensor) -> None:
        self.store = store
        self.where = data.device
        self.device: torch.Tensor | None = data
        """The forward's storage until the call returns, then the copy back while backward uses it."""
        self.arrived: Any = None
        self.host = store.copy_out(data)
        self.saves = 0
        self.unpacked = 0

    def fetch(self) -> None:
        if self.device is None:
            self.device, self.arrived = self.store.copy_in(self.host, self.where)

    def unpack(self, saved: _Saved) -> torch.Tensor:
        self.fetch()
        self.store.wait_in(self.arrived)
        data = self.device
        assert data is not None
        self.unpacked += 1
        if self.unpacked % self.saves == 0:  # every save of it has been unpacked (again, under retain_graph)
            self.device = None
        out = torch.empty(0, dtype=saved.dtype, device=data.device)
        return out.set_(data.untyped_storage(), saved.offset, saved.size, saved.stride)


class _Return:
    """The copies one forward of an offloaded call made, in the order backward needs them:
    the first is fetched when backward first unpacks anything the call saved, each next one
    when the one before it is first unpacked."""

    def __init__(self, marker: MachineryMarker) -> None:
        self.marker = marker
        self.order: list[_Copy] = []
        self.started = False

    def unpack(self, copy: _Copy | None, saved: Any) -> torch.Tensor:
        with self.marker:
            if not self.started:
                self.started = True
                self._fetch(0)
            if copy is None:
                return saved
            out = copy.unpack(saved)
            self._fetch(self.order.index(copy) + 1)
            return out

    def _fetch(self, k: int) -> None:
        if k < len(self.order):
            self.order[k].fetch()


@dataclass(frozen=True, slots=True)
class _Saved:
    """What autograd keeps of an offloaded save: the copy and the view of it that was saved."""

    back: _Return
    copy: _Copy
    dtype: torch.dtype
    offset: int
    size: torch.Size
    stride: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class _Kept:
    """A save of the call left on the device: its first unpack starts the way back."""

    back: _Return
    tensor: torch.Tensor


def _unpack(saved: Any) -> torch.Tensor:
    if isinstance(saved, _Saved):
        return saved.back.unpack(saved.copy, saved)
    if isinstance(saved, _Kept):
        return saved.back.unpack(None, saved.tensor)
    return saved


class _Offload:
    """Saved-tensor hooks around one module's forward, for one offload decision."""

    def __init__(
        self,
        module: nn.Module,
        decision: OffloadDecision,
        store: Callable[[torch.device], HostStore],
        marker: MachineryMarker,
    ) -> None:
        self.module = module
        self.marker = marker
        self.decision = decision
        self.moved = frozenset(decision.packs)
        self.store = store
        self.hooks: Any = None
        self.saves = 0
        self.failed = False
        self.copies: dict[tuple[torch.device, int], _Copy] = {}
        self.first_save: dict[int, _Copy] = {}
        self.back = _Return(marker)

    def install(self) -> None:
        self.module.register_forward_pre_hook(self._start)
        self.module.register_forward_hook(self._finish, always_call=True)

    def _start(self, module: nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled():
            return
        self.saves, self.copies, self.first_save, self.back = 0, {}, {}, _Return(self.marker)
        self.failed = False
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self.hooks.__enter__()

    def _pack(self, tensor: torch.Tensor) -> Any:
        ordinal, self.saves = self.saves, self.saves + 1
        if ordinal not in self.moved:
            return _Kept(self.back, tensor)
        if tensor.layout != torch.strided:
            raise FingerprintError(
                f"offload of '{self.decision.module}': save {ordinal} is a {tensor.layout} tensor, "
                "which the profile did not see"
            )
        key = (tensor.device, tensor.untyped_storage().data_ptr())
        copy = self.copies.get(key)
        if copy is None:
            with self.marker:
                copy = self.copies[key] = self.first_save[ordinal] = _Copy(self._store(tensor), storage_bytes(tensor))
        copy.saves += 1
        return _Saved(self.back, copy, tensor.dtype, tensor.storage_offset(), tensor.size(), tensor.stride())

    def _store(self, tensor: torch.Tensor) -> HostStore:
        try:
            return self.store(tensor.device)
        except DeviceError:
            self.failed = True  # the forward ends here: its save count means nothing
            raise

    def _finish(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.hooks is None:
            return
        self.hooks.__exit__(None, None, None)
        self.hooks = None
        with self.marker:
            for store in {id(c.store): c.store for c in self.copies.values()}.values():
                store.wait_out()
        for copy in self.copies.values():
            copy.device = None  # the forward's reference: the storage dies with Python's last one
        self.back.order = [self.first_save[n] for n in self.decision.fetch_order if n in self.first_save]
        if not self.failed and self.saves != self.decision.saves:
            raise FingerprintError(
                f"offload of '{self.decision.module}': its forward saved {self.saves} tensors for "
                f"backward, the schedule expects {self.decision.saves} (a changed model?)"
            )


def pinned_host_store() -> Callable[[torch.device], HostStore]:
    """One ``PinnedHost`` per CUDA device; refuses any other device."""
    stores: dict[torch.device, HostStore] = {}

    def store(device: torch.device) -> HostStore:
        if device.type != "cuda":
            raise DeviceError(f"offload needs a CUDA device: this model runs on {device.type}")
        if device not in stores:
            stores[device] = PinnedHost(device)
        return stores[device]

    return store


def install_offloads(
    modules: Iterable[nn.Module],
    offloads: Iterable[OffloadDecision],
    marker: MachineryMarker,
    store: Callable[[torch.device], HostStore] | None = None,
) -> None:
    """Hook each offloaded call's module (``modules``, in the order of ``offloads``; the
    copies' ops run under ``marker``; ``store``: where the copies go, by device, pinned host
    memory on CUDA by default)."""
    chosen = store or pinned_host_store()
    for module, decision in zip(modules, offloads, strict=True):
        _Offload(module, decision, chosen, marker).install()
