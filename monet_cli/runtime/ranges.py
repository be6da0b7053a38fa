"""Op-range segments (``core/ranges.py``) at run time: a checkpoint frame over a stretch of one
module's forward, its own code included.

The frame is the generator ``torch.utils.checkpoint`` drives around its function: it opens in
the hook where the range starts (the start of one of the module's calls, or of its forward)
and closes where it ends. Between the two, a recorder writes a tape of what the forward ran:
each call the module makes (module and arguments) and each torch call of its own code
(function and arguments); it steps off its mode stack while a call runs. The recompute
replays the tape: calls as calls, so their hooks, nested segments and BatchNorm guards run as
in any recompute, and own torch calls as the same calls under the same grad and autocast
state, so autograd saves the same tensors in the same order.

The tape is written at the level of torch functions (a ``TorchFunctionMode``): one entry for
``F.scaled_dot_product_attention`` where the aten level holds its dozen ops, and none for
reading a shape. The first forward of each range writes its tape op by op instead (a
``TorchDispatchMode``), as the profile counted them: it checks the own ops against the
profile's, and whether every own op ran inside a torch call whose result the tape can follow.
A range whose code runs ops no torch call shows (a C++ extension called directly), or hands a
result on through a numpy array, stays op by op. On a tiny_gpt block alone (41 own ops, 13
torch calls; 81 interleaved rounds, 12-06) the tape cost 32 us an own op by torch calls
against 83 op by op, over plain checkpoint of the block; its recording 5 us against 35.

The tape never holds what the range makes: arguments made inside it are positions in the
replay's own list, and the replay drops each position once the last entry reading it has
run, though the forward's Python may have kept it longer (a local read once, or the query,
key and value views holding an attention's projection until the function returns):
``SegmentModel.replay_drop`` is the simulator's rule. What the range reads from
before it is held by the tape until the range closes; then autograd saves it, as checkpoint
saves its arguments, through the saved-tensor hooks around the range: in an enclosing
checkpoint frame (a nested range) that frame drops it and its recompute makes it again, and
with no frame around, autograd holds it until the range's backward is done. An own call that
writes a tensor from before the range (a buffer) has that tensor's value put back after its
replay.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.overrides import TorchFunctionMode, _get_current_function_mode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes, _get_current_dispatch_mode
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import noop_context_fn

from monet_cli.core.schedule import SegmentDecision
from monet_cli.errors import FingerprintError
from monet_cli.runtime.fingerprint import IGNORED_OPS
from monet_cli.runtime.frames import abandon_frame, close_frame, open_frame
from monet_cli.runtime.meter import MachineryMarker


class _Made(NamedTuple):
    """An argument the range made: the replay's value at this position."""

    position: int


class _Before(NamedTuple):
    """An argument from before the range: ``_Tape.before[index]``."""

    index: int


_AUTOCAST_DEVICES = ("cpu", "cuda")
_NO_AUTOCAST: tuple[torch.dtype | None, ...] = (None,) * len(_AUTOCAST_DEVICES)


def _autocast_state() -> tuple[torch.dtype | None, ...]:
    """Per device, the dtype autocast casts to (None: off)."""
    if not torch._C._is_any_autocast_enabled():
        return _NO_AUTOCAST
    return tuple(
        torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None for device in _AUTOCAST_DEVICES
    )


def _autocast_as(state: tuple[torch.dtype | None, ...], now: tuple[torch.dtype | None, ...]) -> contextlib.ExitStack:
    """Autocast as in ``state`` on each device where it differs from ``now``."""
    stack = contextlib.ExitStack()
    for device, dtype, current in zip(_AUTOCAST_DEVICES, state, now):
        if dtype != current:
            stack.enter_context(torch.autocast(device, dtype=dtype, enabled=dtype is not None))
    return stack


@dataclass
class _Entry:
    run: Callable[..., Any]
    """The torch function or aten overload, or the module, to call again."""
    leaves: list[Any]
    """Its flattened (args, kwargs), tensors replaced by ``_Made`` / ``_Before``."""
    spec: Any
    """How to rebuild (args, kwargs) from the leaves: an ``_ArgLayout``, or a pytree spec."""
    outputs: list[int | None]
    """Replay position of each flattened output leaf (None: not a tensor)."""
    writes: tuple[int, ...] = ()
    """Positions in ``leaves`` of the tensors from before the range that it writes in place."""
    grad: bool = True
    autocast: tuple[torch.dtype | None, ...] = _NO_AUTOCAST
    """Autocast as the entry ran: an aten op runs without it (autocast chose its dtypes already,
    and its casts are on the tape)."""
    is_call: bool = False
    drop: list[int] = field(default_factory=list)
    """Positions no entry from this one on reads: the replay drops them before it runs."""


@dataclass
class _Tape:
    entries: list[_Entry] = field(default_factory=list)
    before: list[torch.Tensor | None] = field(default_factory=list)
    before_index: dict[int, int] = field(default_factory=dict)
    """``id`` of each tensor in ``before`` -> its index, while recording (the list holds them
    then, so ids stay theirs; ``save_before`` empties their places when the range closes)."""
    positions: int = 0
    saved: torch.Tensor | None = None
    """Once the range closed: the output of the autograd node that saved ``before[k]`` for
    each ``k`` in ``saved_at`` (those entries of ``before`` are then None)."""
    saved_at: tuple[int, ...] = ()

    def save_before(self) -> None:
        """Hand what the range read from before it to autograd's saved-tensor hooks, all but
        parameters (which live anyway) and tensors an own call writes (their value is put back
        around the replay, which a saved tensor's version check would refuse)."""
        written = {e.leaves[k].index for e in self.entries for k in e.writes}
        at = tuple(k for k, t in enumerate(self.before) if not isinstance(t, nn.Parameter) and k not in written)
        if not at:
            return
        with torch.enable_grad():
            self.saved = _SaveBefore.apply(torch.empty(0, requires_grad=True), *(self.before[k] for k in at))
        self.saved_at = at
        for k in at:
            self.before[k] = None

    def drop_after_last_use(self) -> None:
        """Give each entry the positions the replay drops before running it: those no later
        entry reads (an output nothing reads goes right after the entry that made it)."""
        last: dict[int, int] = {}
        for index, entry in enumerate(self.entries):
            for position in entry.outputs:
                if position is not None:
                    last[position] = index
            for leaf in entry.leaves:
                if isinstance(leaf, _Made):
                    last[leaf.position] = index
        for position, index in last.items():
            if index + 1 < len(self.entries):
                self.entries[index + 1].drop.append(position)

    def unpacked_before(self) -> list[torch.Tensor | None]:
        """``before`` with the saved tensors back (in a nested range, the enclosing frame's recompute made them)."""
        before = list(self.before)
        if self.saved is not None:
            for k, tensor in zip(self.saved_at, self.saved.grad_fn.saved_tensors):
                before[k] = tensor
        return before


class _SaveBefore(torch.autograd.Function):
    """Saves its tensor arguments; never run backward (its output reaches no loss)."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*tensors)
        return anchor.new_empty(0)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise AssertionError("internal error: the node holding a range's inputs ran backward")


class _OffDuringCalls:
    """A mode that steps off its stack while the module's calls run (their ops are theirs, and
    pass at no cost), unless another mode was pushed above it: then it stays, and lets their
    ops through."""

    paused = False

    def __init__(self, owner: RangeSegment) -> None:
        super().__init__()
        self.owner = owner

    def on_top(self) -> bool:
        raise NotImplementedError

    def pause(self) -> None:
        if self.on_top():
            self.__exit__(None, None, None)
            self.paused = True

    def resume(self) -> None:
        if self.paused:
            self.__enter__()
            self.paused = False


_FOLLOWED = (torch.Tensor, int, float, bool, complex, str, type(None), torch.dtype, torch.device, torch.layout)
"""What a torch call may return, flattened, for its torch calls to write a range's tape."""


class _FunctionRecorder(_OffDuringCalls, TorchFunctionMode):
    """Writes the module's own torch calls to the tape; in a range's first forward (``writes``
    False) it only counts them and marks when one runs, for the op recorder's check."""

    def __init__(self, owner: RangeSegment, *, writes: bool) -> None:
        super().__init__(owner)
        self.writes = writes

    def on_top(self) -> bool:
        return _get_current_function_mode() is self

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owner = self.owner
        if owner.in_call is not None:
            return func(*args, **kwargs)
        owner.torch_calls += 1
        if self.writes:
            return owner.record(func, args, kwargs, _autocast_state())
        owner.in_torch_call += 1
        try:
            output = func(*args, **kwargs)
        finally:
            owner.in_torch_call -= 1
        if not all(isinstance(leaf, _FOLLOWED) for leaf in _output_leaves(output)):
            owner.ops_only = True  # a numpy array, say: what is made from it would look older than the range
        return output


class _OpRecorder(_OffDuringCalls, TorchDispatchMode):
    """Writes the module's own aten ops to the tape (a range's first forward), counting them as
    the profile does, and those no torch function call ran."""

    def on_top(self) -> bool:
        return _get_current_dispatch_mode() is self

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owner = self.owner
        if owner.in_call is not None:
            return func(*args, **kwargs)
        if _counted(func):
            owner.own_ops += 1
        if not owner.in_torch_call:
            owner.ops_only = True
        owner.unreplayable = owner.unreplayable or unreplayable(args, kwargs)
        return owner.record(func, args, kwargs, _NO_AUTOCAST)


def unreplayable(args: tuple, kwargs: dict) -> str:
    """Why a range's replay cannot repeat this aten op, as its own code ran it ("" when it can)."""
    # Only a custom Function's forward runs with forward-mode AD off (inference mode aside,
    # which saves nothing for backward).
    if not torch._C._is_fwd_grad_enabled():
        return "calls a custom autograd Function"
    # Even the default generator passed by name arrives as another object: any is refused.
    if any(isinstance(arg, torch.Generator) for arg in (*args, *kwargs.values())):
        return "draws random numbers from a generator it passes"
    return ""


# The tape's own Python runs at every own call, twice (record and replay): arguments nest at
# most one list deep almost always, so they are flattened by hand (pytree's generic walk was
# the tape's largest cost on attention code), and what each overload is is looked up once.
@functools.cache
def _counted(func: Any) -> bool:
    """An own op as the profile counts them."""
    return str(func) not in IGNORED_OPS


@functools.cache
def _written_arguments(func: Any) -> tuple[tuple[int, str, bool], ...]:
    """(position, name, keyword-only) of each argument ``func`` writes in place (its schema's alias info says which)."""
    return tuple(
        (k, arg.name, arg.kwarg_only)
        for k, arg in enumerate(func._schema.arguments)
        if arg.alias_info is not None and arg.alias_info.is_write
    )


def written_tensors(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensor arguments ``func`` writes in place."""
    written = []
    for k, name, kwarg_only in _written_arguments(func):
        value = kwargs.get(name) if kwarg_only or k >= len(args) else args[k]
        written += [t for t in (value if isinstance(value, (list, tuple)) else (value,)) if isinstance(t, torch.Tensor)]
    return written


_SEQUENCES = (list, tuple, torch.Size)
"""Argument containers flattened by hand, and rebuilt as the same type (``x[a, b]`` indexes with
a tuple, where a list would be another index)."""


class _ArgLayout(NamedTuple):
    """Where a call's arguments sit among its leaves: per argument, None for a single value or
    the container type and length of a sequence, then the keyword names."""

    sequences: tuple[tuple[type, int] | None, ...]
    positional: int
    names: tuple[str, ...]


def _arg_leaves(args: tuple, kwargs: dict) -> tuple[list[Any], Any]:
    leaves: list[Any] = []
    sequences: list[tuple[type, int] | None] = []
    for value in (*args, *kwargs.values()):
        kind = type(value)
        if kind in _SEQUENCES and _flat(value):
            sequences.append((kind, len(value)))
            leaves.extend(value)
        elif isinstance(value, (list, tuple, dict)):
            return tree_flatten((args, kwargs))
        else:
            sequences.append(None)
            leaves.append(value)
    return leaves, _ArgLayout(tuple(sequences), len(args), tuple(kwargs))


def _arguments(leaves: list[Any], spec: Any) -> tuple[Any, dict[str, Any]]:
    if not isinstance(spec, _ArgLayout):
        return tree_unflatten(leaves, spec)
    values, k = [], 0
    for sequence in spec.sequences:
        if sequence is None:
            values.append(leaves[k])
            k += 1
        else:
            kind, length = sequence
            values.append(kind(leaves[k : k + length]))
            k += length
    return values[: spec.positional], dict(zip(spec.names, values[spec.positional :]))


def _flat(sequence: Sequence[Any]) -> bool:
    """No container inside: the sequence's items are its leaves."""
    return not any(isinstance(item, (list, tuple, dict)) for item in sequence)


def _output_leaves(output: Any) -> Sequence[Any]:
    """A call's outputs, flattened."""
    if isinstance(output, torch.Tensor):
        return (output,)
    if isinstance(output, (list, tuple)) and _flat(output):
        return output
    return tree_flatten(output)[0]


class RangeSegment:
    """One op range of the schedule, installed on its module and the modules it calls."""

    def __init__(
        self, decision: SegmentDecision, parent: nn.Module, calls: list[nn.Module], marker: MachineryMarker
    ) -> None:
        self.decision = decision
        self.parent = parent
        self.calls = calls
        self.marker = marker
        self.forward = parent.forward
        self.frame: Any = None
        self.tape: _Tape | None = None
        self.modes: list[_OffDuringCalls] = []
        self.in_call: nn.Module | None = None
        """The call the module is making while the range runs (its ops are that call's)."""
        self.call_entry: _Entry | None = None
        self.running = False
        """Inside the module's forward (with grad): its calls are counted."""
        self.seen: dict[int, int] = defaultdict(int)
        self.replaying = 0
        self.own_ops = 0
        """Own aten ops, counted in a forward recorded op by op."""
        self.torch_calls = 0
        """Own torch calls, counted in every forward."""
        self.in_torch_call = 0
        self.ops_only = False
        """Some own code runs ops no torch call shows, or returns what the tape cannot follow."""
        self.unreplayable = ""
        """Why the replay cannot repeat an own op of the first forward (``OpRecord.unreplayable``)."""
        self.first_torch_calls: int | None = None
        """Own torch calls of the first forward, once it showed the torch calls can write the tape."""
        self.ids: dict[int, int] = {}
        """``id`` of each live tensor the range made -> its replay position (a tensor's death
        removes it before its id can be another's)."""
        self.watch: list[weakref.ref] = []

    def install(self) -> None:
        @functools.wraps(self.forward)
        def forward(*args: Any, **kwargs: Any) -> Any:
            return self._parent_forward(*args, **kwargs)

        self.parent.forward = forward
        # The call starts before any other hook of it runs and ends after them (BatchNorm
        # guards prepend theirs): what those hooks run is the call's, not the model's own code.
        for module in {id(m): m for m in self.calls}.values():
            module.register_forward_pre_hook(self._call_starts, with_kwargs=True, prepend=True)
            module.register_forward_hook(self._call_ends)

    # -- the module's forward -------------------------------------------------------
    def _parent_forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.replaying or self.running or not torch.is_grad_enabled():
            return self.forward(*args, **kwargs)
        self.running, self.seen, self.in_call = True, defaultdict(int), None
        try:
            if not self.decision.opens_at_call:
                self._open((args, kwargs))
            output = self.forward(*args, **kwargs)
            if self.frame is not None and not self.decision.closes_at_call:
                self._close_checked()
            if self.tape is None or self.frame is not None:
                self._fail("the forward ended before the range did")
            return output
        finally:
            self._abandon()
            self.running = False

    def _call_starts(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not self.running or self.replaying or self.in_call is not None:
            return
        occurrence = self.seen[id(module)]
        self.seen[id(module)] += 1
        if self.frame is None and self.tape is None and module is self.calls[0] and occurrence == self.decision.skip:
            self._open((args, kwargs))
        if self.frame is not None:
            self.in_call = module
            leaves, spec = _arg_leaves(args, kwargs)
            self.call_entry = self.entry(module, leaves, spec, is_call=True)
            for mode in self.modes:
                mode.pause()

    def _call_ends(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self.frame is None or self.in_call is not module or self.replaying:
            return
        self.in_call = None
        for mode in self.modes:
            mode.resume()
        self.made(self.call_entry, _output_leaves(output))
        if self.decision.closes_at_call and sum(e.is_call for e in self.tape.entries) == len(self.calls):
            self._close_checked()

    # -- recording --------------------------------------------------------------------
    def record(self, run: Any, args: tuple, kwargs: dict, autocast: tuple[torch.dtype | None, ...]) -> Any:
        """Run one own torch call or aten op, and write it to the tape unless it made no tensor
        and wrote none: then its result, a shape or a number, is in the arguments of what
        used it, and there is nothing to replay."""
        grad = torch.is_grad_enabled()
        leaves, spec = _arg_leaves(args, kwargs)
        if isinstance(run, torch._ops.OpOverload):
            # Below autograd an in-place op has not bumped its tensors' versions yet: its schema says.
            output = run(*args, **kwargs)
            writing = written_tensors(run, args, kwargs)
            written = [k for k, leaf in enumerate(leaves) if any(leaf is t for t in writing)] if writing else []
        else:
            versions = [(k, leaf._version) for k, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
            output = run(*args, **kwargs)
            written = [k for k, version in versions if leaves[k]._version != version]
        outputs = _output_leaves(output)
        if not written and not any(isinstance(leaf, torch.Tensor) for leaf in outputs):
            return output
        entry = self.entry(run, leaves, spec, grad=grad, autocast=autocast)
        entry.writes = tuple(k for k in written if isinstance(entry.leaves[k], _Before))
        self.made(entry, outputs)
        return output

    def entry(
        self,
        run: Any,
        leaves: list[Any],
        spec: Any,
        *,
        grad: bool = True,
        autocast: tuple[torch.dtype | None, ...] = _NO_AUTOCAST,
        is_call: bool = False,
    ) -> _Entry:
        refs = [self._ref(leaf) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        tape = self.tape
        entry = _Entry(
            run=run,
            leaves=refs,
            spec=spec,
            outputs=[],
            grad=grad,
            autocast=autocast,
            is_call=is_call,
        )
        tape.entries.append(entry)
        return entry

    def _ref(self, tensor: torch.Tensor) -> _Made | _Before:
        position = self.ids.get(id(tensor))
        if position is not None:
            return _Made(position)
        tape = self.tape
        index = tape.before_index.get(id(tensor))
        if index is None:
            index = tape.before_index[id(tensor)] = len(tape.before)
            tape.before.append(tensor)
        return _Before(index)

    def made(self, entry: _Entry, outputs: Sequence[Any]) -> None:
        for leaf in outputs:
            if not isinstance(leaf, torch.Tensor):
                entry.outputs.append(None)
                continue
            position = self.tape.positions
            self.tape.positions += 1
            self.ids[id(leaf)] = position
            entry.outputs.append(position)
            self.watch.append(weakref.ref(leaf, functools.partial(_dropped, self.ids, id(leaf), position)))

    # -- the frame -----------------------------------------------------------------------
    def _open(self, args: Any) -> None:
        tape = self.tape = _Tape()
        device = next((t.device for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)), torch.device("cpu"))
        with self.marker:
            # A tensor on the model's device tells checkpoint whose RNG to restore; it has no bytes.
            anchor = torch.empty(0, device=device)
        self.frame = open_frame(functools.partial(self._replay, tape), noop_context_fn, self.marker, anchor)
        self.own_ops = self.torch_calls = 0
        by_torch_calls = self.first_torch_calls is not None
        self.modes = [_FunctionRecorder(self, writes=by_torch_calls)]
        if not by_torch_calls:
            self.modes.append(_OpRecorder(self))
        for mode in self.modes:
            mode.__enter__()

    def _close_checked(self) -> None:
        self._stop_recording()
        tape = self.tape
        calls = [e.run for e in tape.entries if e.is_call]
        if len(calls) != len(self.calls) or any(a is not b for a, b in zip(calls, self.calls)):
            self._fail("its calls differ from the profiled ones")
        if self.first_torch_calls is None:
            if self.unreplayable:
                self._fail(
                    f"its own code {self.unreplayable}, which a range cannot replay "
                    "(profiles made by this monet offer no such range): profile the model again"
                )
            if self.own_ops != self.decision.own_ops:
                self._fail(
                    f"it ran {self.own_ops} of the module's own ops where the profile saw {self.decision.own_ops}"
                )
            if not self.ops_only:
                self.first_torch_calls = self.torch_calls
        elif self.torch_calls != self.first_torch_calls:
            self._fail(
                f"its own code made {self.torch_calls} torch calls where its first forward made {self.first_torch_calls}"
            )

        tape.drop_after_last_use()
        frame, self.frame = self.frame, None
        close_frame(frame, self.marker)
        with self.marker:
            tape.save_before()

    def _stop_recording(self) -> None:
        modes, self.modes = self.modes, []
        for mode in reversed(modes):
            if not mode.paused:  # paused: a call raised, and the mode is off its stack already
                mode.__exit__(None, None, None)
        self.watch.clear()
        self.ids = {}

    def _abandon(self) -> None:
        """Leave a frame a raising forward left open; forget the tape of a finished one."""
        self._stop_recording()
        frame, self.frame = self.frame, None
        if frame is not None:
            abandon_frame(frame, self.marker)
        self.tape, self.in_call = None, None

    def _fail(self, what: str) -> None:
        self._abandon()
        raise FingerprintError(f"schedule segment '{self.decision.module}' does not match this model: {what}")

    # -- the recompute ---------------------------------------------------------------------
    def _replay(self, tape: _Tape, *_anchor: torch.Tensor) -> None:
        values: list[Any] = [None] * tape.positions
        autocast = _autocast_state()
        self.replaying += 1
        try:
            with self.marker.lowered():
                before = tape.unpacked_before()
                for entry in tape.entries:
                    for position in entry.drop:
                        values[position] = None
                    self._keep_outputs(entry, self._run(entry, before, values, autocast), values)
        finally:
            self.replaying -= 1

    @staticmethod
    def _keep_outputs(entry: _Entry, output: Any, values: list[Any]) -> None:
        # Only ``values`` may hold the outputs once this returns: a local left holding the
        # last entry's output would keep tensors the forward had dropped.
        for position, leaf in zip(entry.outputs, _output_leaves(output)):
            if position is not None:
                values[position] = leaf

    @staticmethod
    def _run(
        entry: _Entry, before: list[torch.Tensor | None], values: list[Any], autocast: tuple[torch.dtype | None, ...]
    ) -> Any:
        leaves = [
            values[leaf.position]
            if isinstance(leaf, _Made)
            else before[leaf.index]
            if isinstance(leaf, _Before)
            else leaf
            for leaf in entry.leaves
        ]
        args, kwargs = _arguments(leaves, entry.spec)
        if entry.is_call or (entry.grad and not entry.writes and entry.autocast == autocast):  # no context to enter
            return entry.run(*args, **kwargs)
        written = [leaves[k] for k in entry.writes]
        with _restored(written), torch.set_grad_enabled(entry.grad), _autocast_as(entry.autocast, autocast):
            return entry.run(*args, **kwargs)


@contextlib.contextmanager
def _restored(tensors: list[torch.Tensor]) -> Iterator[None]:
    """Put back the values of tensors from before the range that an own call writes (a step
    counter, running statistics): the forward wrote them already. The copies are made below
    every dispatch mode, as the BatchNorm guard's are, so the step's memory meter does not count them
    and the replayed call writes the real tensor, whose memory it counts already."""
    if not tensors:
        yield
        return
    with torch.no_grad(), _disable_current_modes():
        saved = [t.clone() for t in tensors]
    try:
        yield
    finally:
        with torch.no_grad(), _disable_current_modes():
            for tensor, value in zip(tensors, saved):
                tensor.copy_(value)


def _dropped(ids: dict[int, int], key: int, position: int, _ref: weakref.ref) -> None:
    """The forward's Python dropped the tensor at ``position``: its ``id`` may name another
    tensor from now on."""
    if ids.get(key) == position:  # an in-place op's output is its input: the later position holds
        del ids[key]
