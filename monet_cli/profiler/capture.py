"""Recorders that run inside a real training step.

``StepRecorder`` sees every aten op of one step (forward, loss, backward, optimizer)
through a dispatch mode, every tensor autograd saves through saved-tensor hooks, module
calls through global module hooks, and when each backward node finishes through node
post-hooks. It is a ``LiveStorageMeter``, so it also knows when each storage is born
and freed.

``LifetimeRecorder`` replays the forward with autograd keeping nothing, which tells
when each activation would die if it were not saved: what a recomputed segment frees.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle

from monet_cli.core.profile import LOSS_MODULE, Profile
from monet_cli.errors import ModelError
from monet_cli.runtime.fingerprint import IGNORED_OPS, signature
from monet_cli.runtime.meter import LiveStorageMeter, free_unreachable, storage_key
from monet_cli.runtime.ranges import unreplayable, written_tensors
from monet_cli.workload.step import Workload, loss_scope


@dataclass
class RawStorage:
    id: int
    bytes: int
    kind: str
    producer: int | None
    alloc: int
    free: int | None = None
    mutated: bool = False
    returned_to: int | None = None
    """The call whose own code the model's forward last handed it to (``StorageRecord.returned_to``)."""


@dataclass
class RawOp:
    pos: int
    op: str
    phase: str
    module: str
    inputs: list[int]
    """Storage ids the op reads."""
    written: list[int]
    """Storage ids the op writes in place."""
    outputs: list[int]
    """Storage ids the op allocated."""
    signature: str
    workspace: int = 0
    """CUDA: allocator bytes the op took and gave back before returning."""
    unreplayable: str = ""
    torch_call_end: int = 0
    """One past the last op of the outermost torch function call that ran it (``_TorchCalls``)."""


@dataclass
class RawCall:
    index: int
    fqn: str
    type: str
    first_op: int
    parent: int | None
    inputs: list[int]
    hand_off: bool
    end_op: int = -1


@dataclass
class RawPack:
    storage: int
    call: int | None
    pos: int
    unpack: int | None = None
    release: int | None = None


class _Packed:
    """What autograd stores instead of the tensor: the tensor itself plus our record."""

    __slots__ = ("tensor", "index")

    def __init__(self, tensor: torch.Tensor, index: int) -> None:
        self.tensor = tensor
        self.index = index


class StepRecorder(LiveStorageMeter):
    """Records the structure and memory timeline of one training step."""

    def __init__(self, workload: Workload) -> None:
        super().__init__(workload.device.type)
        self.workload = workload
        self.pos = 0
        self.phase = "forward"
        self.finished = False
        self.storages: list[RawStorage] = []
        self.by_key: dict[int, int] = {}
        self.ops: list[RawOp] = []
        self.calls: list[RawCall] = []
        self.stack: list[int] = []
        self.returned: dict[int | None, weakref.ref | None] = {}
        """Per parent call, the tensor its last finished call returned (None: not a tensor)."""
        self.packs: list[RawPack] = []
        self.pending_unpacks: list[int] = []
        self.node_hooks: list[RemovableHandle] = []
        self.peak_pos = 0
        self.cuda = workload.device if workload.device.type == "cuda" else None
        self.own_saving: str | None = None
        """Where the model saves tensors for backward its own way (checkpoint, ``save_on_cpu``),
        in words; None where it leaves that to autograd."""

    # -- storages -----------------------------------------------------------------
    def on_alloc(self, key: int, nbytes: int, kind: str, producer: int | None) -> None:
        sid = len(self.storages)
        self.storages.append(RawStorage(id=sid, bytes=nbytes, kind=kind, producer=producer, alloc=self.pos))
        self.by_key[key] = sid
        if self.current_bytes == self.peak_bytes:
            self.peak_pos = self.pos

    def on_free(self, key: int) -> None:
        sid = self.by_key.pop(key)
        if not self.finished:
            self.storages[sid].free = self.pos

    def sid_of(self, tensor: torch.Tensor) -> int:
        return self.by_key[storage_key(tensor)]

    # -- ops --------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.raise_deferred_interrupt()
        kwargs = kwargs or {}
        if str(func) in IGNORED_OPS:
            return func(*args, **kwargs)
        pos = self.pos
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        self.track_unseen_inputs(inputs)
        written = written_tensors(func, args, kwargs)
        if self.phase == "forward" and self.own_saving is None and not self._saving_through_own_hooks():
            self.own_saving = (
                f"saves tensors through hooks of its own in {_where(self._module_path())} "
                "(a non-reentrant torch.utils.checkpoint, or torch.autograd.graph.save_on_cpu)"
            )
        out, workspace = self._run_op(func, args, kwargs)
        outputs = []
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                kind = "activation" if self.phase == "forward" else "temp"
                if self.track(tensor, kind=kind, producer=pos) is not None:
                    outputs.append(self.sid_of(tensor))
        self.ops.append(
            RawOp(
                pos=pos,
                op=str(func),
                phase=self.phase,
                module=self._module_path(),
                inputs=sorted({self.sid_of(t) for t in inputs if t.device.type != "meta"}),
                written=sorted({self.sid_of(t) for t in written if t.device.type != "meta"}),
                outputs=outputs,
                signature=signature(inputs),
                workspace=workspace,
                unreplayable=unreplayable(args, kwargs) if self.phase == "forward" else "",
                torch_call_end=pos + 1,
            )
        )
        self.pos = pos + 1
        return out

    def _saving_through_own_hooks(self) -> bool:
        """Whether the innermost saved-tensor hooks are the recorder's. A model's non-reentrant
        checkpoint or ``save_on_cpu`` pushes its own over them: what it saves, frees and
        recomputes is then out of the recorder's sight."""
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        return top is not None and top[0] == self._pack

    def _run_op(self, func, args: tuple, kwargs: dict) -> tuple[object, int]:
        """Run one op; on CUDA also return its workspace: the allocator's peak during the op above
        its level after it (the allocator counts on the host as kernels are queued, so no sync)."""
        if self.cuda is None:
            return func(*args, **kwargs), 0
        torch.cuda.reset_peak_memory_stats(self.cuda)
        out = func(*args, **kwargs)
        peak, after = torch.cuda.max_memory_allocated(self.cuda), torch.cuda.memory_allocated(self.cuda)
        return out, max(0, peak - after)

    def _module_path(self) -> str:
        if loss_scope.active:
            return LOSS_MODULE
        if self.phase != "forward":
            return ""
        return self.calls[self.stack[-1]].fqn if self.stack else ""

    # -- module calls -----------------------------------------------------------------
    def _pre_hook(self, module: torch.nn.Module, args: object) -> None:
        if self.phase != "forward" or self.finished:
            return
        index = len(self.calls)
        fqn = self.workload.module_names.get(id(module), f"<{type(module).__name__}>")
        parent = self.stack[-1] if self.stack else None
        tensors = [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor) and t.device.type != "meta"]
        self.track_unseen_inputs(tensors)
        inputs = sorted({self.sid_of(t) for t in tensors})
        handed = self.returned.get(parent)
        hand_off = isinstance(args, tuple) and len(args) == 1 and handed is not None and args[0] is handed()
        self.calls.append(  # a keyword makes hand_off False: ``_kwargs_hook``
            RawCall(
                index=index,
                fqn=fqn,
                type=type(module).__name__,
                first_op=self.pos,
                parent=parent,
                inputs=inputs,
                hand_off=hand_off,
            )
        )
        self.stack.append(index)

    def _kwargs_hook(self, module: torch.nn.Module, args: object, kwargs: dict) -> None:
        """Tensors passed by keyword (masks, position embeddings) are inputs too: checkpoint
        holds them like positional ones. Global hooks do not see keywords, module hooks do."""
        if self.phase != "forward" or self.finished or not self.stack or not kwargs:
            return
        call = self.calls[self.stack[-1]]
        if call.fqn != self.workload.module_names.get(id(module)):
            return
        call.hand_off = False
        tensors = [t for t in tree_flatten(kwargs)[0] if isinstance(t, torch.Tensor) and t.device.type != "meta"]
        self.track_unseen_inputs(tensors)
        call.inputs = sorted(set(call.inputs) | {self.sid_of(t) for t in tensors})

    def _post_hook(self, module: torch.nn.Module, args: object, output: object) -> None:
        if self.phase != "forward" or self.finished or not self.stack:
            return
        call = self.calls[self.stack.pop()]
        call.end_op = self.pos
        if call.parent is not None:
            self.hand_back(output, to=call.parent, held_by=call.index)
        # A weak reference: the recorder must not keep an activation alive.
        self.returned[call.parent] = weakref.ref(output) if isinstance(output, torch.Tensor) else None

    def hand_back(self, output: object, *, to: int, made_since: int | None = None, held_by: int | None = None) -> None:
        """Call ``to``'s own code now holds the storages of ``output`` made since op
        ``made_since`` (a torch call it made returned them) or held by call ``held_by`` (a
        call it made returned them)."""
        for tensor in tree_flatten(output)[0]:
            if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta" or not self.is_tracked(tensor):
                continue
            storage = self.storages[self.sid_of(tensor)]
            made_here = made_since is not None and storage.producer is not None and storage.producer >= made_since
            if made_here or (held_by is not None and storage.returned_to == held_by):
                storage.returned_to = to

    # -- autograd ---------------------------------------------------------------------
    def _pack(self, tensor: torch.Tensor) -> _Packed:
        if not self.is_tracked(tensor):
            self.track(tensor, kind="other", producer=None)
        call = self.stack[-1] if self.stack and not loss_scope.active else None
        self.packs.append(RawPack(storage=self.sid_of(tensor), call=call, pos=self.pos))
        return _Packed(tensor, len(self.packs) - 1)

    def _unpack(self, packed: _Packed) -> torch.Tensor:
        record = self.packs[packed.index]
        if record.unpack is None:
            record.unpack = self.pos
            self.pending_unpacks.append(packed.index)
        return packed.tensor

    def _node_done(self, grad_inputs: object, grad_outputs: object) -> None:
        # The engine releases a node's saved tensors right after its post-hooks run.
        for index in self.pending_unpacks:
            self.packs[index].release = self.pos
        self.pending_unpacks.clear()

    def _hook_graph(self, loss: torch.Tensor) -> None:
        # Keyed by id but holding the nodes: a node's Python object can die once visited, and
        # a later one may then reuse its id (torch 2.11 hands out fresh objects).
        seen: dict[int, object] = {}
        todo = [loss.grad_fn]
        while todo:
            node = todo.pop()
            if node is None or id(node) in seen:
                continue
            seen[id(node)] = node
            if self.own_saving is None and node.name() == "CheckpointFunctionBackward":
                self.own_saving = "calls a reentrant torch.utils.checkpoint"  # its forward saves nothing, under no_grad
            self.node_hooks.append(node.register_hook(self._node_done))
            todo.extend(next_node for next_node, _ in node.next_functions)

    def _on_phase(self, phase: str, loss: torch.Tensor) -> None:
        if phase == "backward":
            self._hook_graph(loss)
        self.phase = phase

    # -- driver -----------------------------------------------------------------------
    def record_step(self) -> None:
        """Run one step (grads cleared first) and record it."""
        w = self.workload
        w.zero_grad()
        self.track_resident(w.resident_tensors())
        self._record_untracked()
        handles = [
            torch.nn.modules.module.register_module_forward_pre_hook(self._pre_hook),
            torch.nn.modules.module.register_module_forward_hook(self._post_hook),
            *(m.register_forward_pre_hook(self._kwargs_hook, with_kwargs=True) for m in w.model.modules()),
        ]
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack), self, _TorchCalls(self):
                w.step(on_phase=self._on_phase)
            self.finished = True
        finally:
            # The node hooks too: the workload holds its output, whose graph would hold them,
            # and they this recorder, the workload and its model, in a cycle gc cannot see.
            for handle in [*handles, *self.node_hooks]:
                handle.remove()
        self._classify_backward_storages()

    def _record_untracked(self) -> None:
        """CUDA: what the allocator holds before the step beyond the tensors above (cuBLAS and
        cuDNN workspaces, made once and kept), as one storage that outlives the step:
        ``max_memory_allocated`` counts it in every step."""
        if self.cuda is None:
            return
        free_unreachable(self.cuda)
        untracked = torch.cuda.memory_allocated(self.cuda) - self.current_bytes
        if untracked > 0:
            self.storages.append(
                RawStorage(id=len(self.storages), bytes=untracked, kind="other", producer=None, alloc=0)
            )

    def _classify_backward_storages(self) -> None:
        w = self.workload
        for param in w.model.parameters():
            if param.grad is not None and self.is_tracked(param.grad):
                self.storages[self.sid_of(param.grad)].kind = "grad"
        if w.optimizer is not None:
            for state in w.optimizer.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor) and self.is_tracked(value):
                        storage = self.storages[self.sid_of(value)]
                        if storage.producer is not None:
                            storage.kind = "optimizer"
        for op in self.ops:
            if op.phase != "forward":
                continue
            for sid in op.written:
                storage = self.storages[sid]
                if storage.kind == "activation" and storage.producer != op.pos:
                    storage.mutated = True


class _TorchCalls(TorchFunctionMode):
    """Marks the ops of each outermost torch function call with where the call ends. A range's
    replay (``runtime/ranges.py``) repeats a module's own code call by call, so what a call
    reads lives until the call returns, however early its ops read it."""

    def __init__(self, recorder: StepRecorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        recorder = self.recorder
        first = recorder.pos
        # The mode is off its stack while ``func`` runs: the calls it makes reach no handler.
        output = func(*args, **(kwargs or {}))
        for op in recorder.ops[first:]:
            op.torch_call_end = recorder.pos
        if recorder.phase == "forward" and recorder.stack:
            recorder.hand_back(output, to=recorder.stack[-1], made_since=first)
        return output


class LifetimeRecorder(LiveStorageMeter):
    """Forward only, autograd keeping nothing: when would each activation die?"""

    def __init__(self) -> None:
        super().__init__()
        self.pos = 0
        self.finished = False
        self.ops: list[str] = []
        self.outputs: list[list[int]] = []
        self.free: dict[int, int | None] = {}
        self._slot: dict[int, int] = {}
        self._next = 0

    def on_alloc(self, key: int, nbytes: int, kind: str, producer: int | None) -> None:
        if producer is None:
            return
        slot = self._next
        self._next += 1
        self._slot[key] = slot
        self.free[slot] = None
        self.outputs[producer].append(slot)

    def on_free(self, key: int) -> None:
        slot = self._slot.pop(key, None)
        if slot is not None and not self.finished:
            self.free[slot] = self.pos

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.raise_deferred_interrupt()
        kwargs = kwargs or {}
        if str(func) in IGNORED_OPS:
            return func(*args, **kwargs)
        pos = self.pos
        self.ops.append(str(func))
        self.outputs.append([])
        out = func(*args, **kwargs)
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                self.track(tensor, kind="activation", producer=pos)
        self.pos = pos + 1
        return out

    def record_forward(self, workload: Workload) -> None:
        self.track_resident(workload.resident_tensors())
        with torch.autograd.graph.saved_tensors_hooks(lambda t: None, _never_unpacked), self:
            loss = workload.forward_loss()
        self.finished = True
        del loss


def _never_unpacked(packed: object) -> torch.Tensor:
    raise RuntimeError("monet: lifetime pass runs forward only")


class OpTimer(TorchDispatchMode):
    """Wall time of every aten op in a step, in order."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.sync = device.type == "cuda"
        self.names: list[str] = []
        self.times_ms: list[float] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in IGNORED_OPS:
            return func(*args, **(kwargs or {}))
        if self.sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        if self.sync:
            torch.cuda.synchronize()
        self.times_ms.append((time.perf_counter() - start) * 1000.0)
        self.names.append(str(func))
        return out


class CallTimer:
    """A plain step's wall time, and each module call's forward in it, in call order (its
    Python included).

    A recompute re-runs a call's code, not only its ops: the op timer sees kernels alone, and
    its dispatch mode slows them unevenly. Global module hooks cost a few microseconds a call
    and no dispatch mode runs, so the step runs as a plain one does, and the calls' times and
    the step's come from the same step. On CUDA the hooks record events rather than wait for
    the device, so the step keeps its overlap of launches and kernels."""

    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        self.cuda = workload.device.type == "cuda"
        self.spans: list[list[Any]] = []
        self._open: list[int] = []
        self._forward = False

    def step(self) -> tuple[float, list[float]]:
        """One step, grads cleared first: (its wall time, the forward's call times), in ms."""
        self.spans, self._forward = [], True
        handles = [
            torch.nn.modules.module.register_module_forward_pre_hook(self._pre_hook),
            torch.nn.modules.module.register_module_forward_hook(self._post_hook),
        ]
        try:
            step_ms = self.workload.timed_step(on_phase=self._on_phase)
        finally:
            for handle in handles:
                handle.remove()
        return step_ms, [self._elapsed_ms(begin, end) for begin, end in self.spans]

    def _mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _elapsed_ms(self, begin: Any, end: Any) -> float:
        return begin.elapsed_time(end) if self.cuda else (end - begin) * 1000.0

    def _on_phase(self, phase: str, _loss: torch.Tensor) -> None:
        self._forward = False

    def _pre_hook(self, module: torch.nn.Module, args: object) -> None:
        if self._forward:
            self._open.append(len(self.spans))
            self.spans.append([self._mark(), None])

    def _post_hook(self, module: torch.nn.Module, args: object, output: object) -> None:
        if self._forward and self._open:
            self.spans[self._open.pop()][1] = self._mark()


@dataclass
class Timings:
    step_ms: list[float] = field(default_factory=list)
    op_ms: list[list[float]] = field(default_factory=list)
    call_ms: list[list[float]] = field(default_factory=list)
    as_written_step_ms: float | None = None

    def median_step_ms(self) -> float:
        return statistics.median(self.step_ms)

    def median_op_ms(self) -> list[float]:
        return [statistics.median(column) for column in zip(*self.op_ms)]

    def median_call_ms(self, parents: Sequence[int | None]) -> list[float]:
        """Each call's wall time, holding its sub-calls' as every timed step's does: the median
        of the time a call spends outside its sub-calls, plus its sub-calls' times. Medians of
        nested spans taken one by one need not nest (resnet18: layer3 1.72 ms against its
        blocks' 1.83), and a stretch of a call is priced from its wall over its parts'."""
        own = [
            statistics.median(column) for column in zip(*(_outside_sub_calls(step, parents) for step in self.call_ms))
        ]
        total = list(own)
        for call in reversed(range(len(total))):  # a sub-call comes after its parent
            if parents[call] is not None:
                total[parents[call]] += total[call]
        return total


def retimed(profile: Profile, timings: Timings) -> Profile:
    """``profile`` in the time of the steps ``timings`` holds (plain steps with their calls
    timed, as ``CallTimer`` times them): its step and its calls' wall times their medians, and
    every other price it holds in ms (the model as written, the checkpoint machinery, operator
    variants) scaled by their step over the profile's.

    The machine's speed does not change every part of a step alike: on this 2-core CPU
    tiny_gpt steps of 77 ms against 64 ran their backward ops 34 to 41% slower and their
    blocks' forwards 12 to 14%, so what a recompute re-runs (forward code) is a smaller share
    of a slow step than of a fast one."""
    if any(len(row) != len(profile.calls) for row in timings.call_ms):
        raise ModelError("the model made different module calls in two steps; monet needs the same calls every step")
    step_ms = timings.median_step_ms()
    speed = step_ms / profile.baseline.step_ms
    call_ms = timings.median_call_ms([call.parent for call in profile.calls])
    as_written = profile.baseline.as_written_step_ms
    return replace(
        profile,
        baseline=replace(
            profile.baseline, step_ms=step_ms, as_written_step_ms=None if as_written is None else as_written * speed
        ),
        calls=tuple(
            replace(call, time_ms=None if call.time_ms is None else call_ms[call.index]) for call in profile.calls
        ),
        overheads=replace(
            profile.overheads,
            **{
                f.name: value * speed
                for f in dataclasses.fields(profile.overheads)
                if f.name.endswith("_ms") and (value := getattr(profile.overheads, f.name)) is not None
            },
        ),
        variants=tuple(replace(v, time_ms=v.time_ms * speed) for v in profile.variants),
    )


def _outside_sub_calls(call_ms: Sequence[float], parents: Sequence[int | None]) -> list[float]:
    own = list(call_ms)
    for call, parent in enumerate(parents):
        if parent is not None:
            own[parent] -= call_ms[call]
    return own


def _where(path: str) -> str:
    return f"'{path}'" if path else "the model's own code"
