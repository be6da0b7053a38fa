"""The simulator: predicted peak memory and step time of any schedule, from a profile.

It is the single source of truth for predictions: the solver's result and every
baseline are scored here, and tests hold it to measured runs.

The step is replayed as a list of memory events. Each storage of the profile is born and
freed at recorded positions; a schedule moves those events:

- an activation saved only inside a checkpointed segment dies in the forward when Python
  drops it (``free_no_autograd``) instead of when backward releases it;
- a recompute burst at the segment's first backward use re-runs its ops, allocating a
  fresh copy of each saved activation (held until its nodes release it) and transient
  outputs that die when the re-run ends;
- an op output the segment's selective policy keeps is cached until that burst;
- storages made before the segment and saved inside it live until the segment's last
  saved tensor is released (checkpoint holds its inputs);
- under a nested segment's outer frame, the inner call's arguments are saved by the outer
  frame instead: the recompute of the nearest enclosing frame that made them makes them
  again, and they live until the inner recompute has taken them (and until its own saves
  of them are released); made before every enclosing frame, the outermost one holds them.
  An op range saves what it read when it closes, so an outer recompute runs through it.

Operator variants change the profile itself (``monet_cli/core/variants.py``): a plan with
variants is the plan simulated on the profile rewritten as if they ran.

On CUDA an op may also take workspace from the allocator while it runs (cuBLAS, cuDNN): it
is live from the op's allocations until the frees before the next op, in the forward, in
backward and in every recompute burst that re-runs the op.

Event keys are tuples so plain ordering puts, at position t: frees before op t
``(t, 0)``, then recompute bursts ``(t, 1, -first op of the outermost segment, depth, op,
sub)``, then op t's allocations ``(t, 2)``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from itertools import combinations

from monet_cli.core.allocator import allocator_peak, leaves_blocks_unsplit
from monet_cli.core.profile import Profile, StorageRecord
from monet_cli.core.segments import NEST_LEVELS, Frame, SegmentModel
from monet_cli.core.variants import with_variants

Plan = dict[int, frozenset[int]]
"""Chosen segments: module call index -> op indices whose outputs are kept."""

Key = tuple[int, ...]

BEFORE_STEP: Key = (-1, 2)
"""Where a storage made before the step (parameters, optimizer state, inputs) is allocated."""

WORKSPACE = -1
"""Owner of a workspace event in ``_Events.owners`` (storage ids are >= 0)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SimResult:
    peak_bytes: int
    """What the device's meter counts at the peak: the requests' sum, or on a CUDA profile whose
    allocator leaves blocks unsplit, the allocator's replayed blocks (``core.allocator``)."""
    requested_peak_bytes: int
    """The peak of the requests' sum, at ``peak_pos`` (what the linear memory model adds up)."""
    peak_pos: int
    step_ms: float
    recompute_ms: float
    """Predicted time of the schedule's recomputes (``SegmentModel.recompute_ms``)."""
    added_ms: float
    """recompute_ms plus the checkpoint machinery, the variants and the checks: step_ms -
    baseline step_ms."""
    checks_ms: float
    """What the schedule's checks on every training forward add (``Overheads.checks_ms``): paid
    by every plan, the empty one too (``apply`` installs them whatever the schedule holds, as it
    runs the prepared model)."""
    timeline: tuple[tuple[int, int], ...] = ()
    """(position, live bytes after that position's allocations), if requested."""


Variants = frozenset[int]
"""Chosen operator variants: indices into ``Profile.variants``."""


def memory_events(model: SegmentModel, plan: Plan, variants: Variants = frozenset()) -> list[tuple[Key, int]]:
    """Every (key, +/- bytes) memory event of the step under ``plan`` and ``variants``, unsorted."""
    return _events(model, plan, variants).items


def variant_delta_events(model: SegmentModel, index: int) -> list[tuple[Key, int]]:
    """``memory_events({}, {index})`` minus ``memory_events({})``, from the storages the
    variant changes and those it adds (what it keeps, its temporaries); the others cancel."""
    changed = SegmentModel(with_variants(model.profile, (index,)), offer_offloads=False)
    storages = list(model.variant_storages[index])
    temporaries = range(len(model.profile.storages), len(changed.profile.storages))
    after, before = _Events(changed, {}), _Events(model, {})
    for sid in [*storages, *temporaries]:
        after.add_storage(changed.profile.storages[sid])
    for sid in storages:
        before.add_storage(model.profile.storages[sid])
    return after.items + [(key, -delta) for key, delta in before.items]


def segment_delta_events(model: SegmentModel, call: int, kept: frozenset[int]) -> list[tuple[Key, int]]:
    """``memory_events({call: kept})`` minus ``memory_events({})``, computed from the storages
    that checkpointing ``call`` can move (the others cancel): what the solver's linear model
    needs for every segment and keep, without simulating the whole step each time."""
    return _signed_events(model, (({call: kept}, 1), ({}, -1)), model.touched_storages(call))


def nest_delta_events(model: SegmentModel, outer: int, inner: int) -> list[tuple[Key, int]]:
    """What nesting ``inner`` in ``outer`` adds beyond choosing each alone:
    ``memory_events({outer, inner}) - memory_events({outer}) - memory_events({inner}) +
    memory_events({})``, from the storages either segment can move."""
    bare = frozenset()
    signed = (({outer: bare, inner: bare}, 1), ({outer: bare}, -1), ({inner: bare}, -1), ({}, 1))
    touched = sorted(set(model.touched_storages(outer)) | set(model.touched_storages(inner)))
    return _signed_events(model, signed, touched)


def triple_delta_events(model: SegmentModel, outer: int, middle: int, inner: int) -> list[tuple[Key, int]]:
    """What nesting three levels adds beyond its two nest pairs: ``memory_events({outer, middle,
    inner}) - memory_events({outer, middle}) - memory_events({middle, inner}) +
    memory_events({middle})``, from the storages any of the three can move."""
    bare = frozenset()
    signed = (
        ({outer: bare, middle: bare, inner: bare}, 1),
        ({outer: bare, middle: bare}, -1),
        ({middle: bare, inner: bare}, -1),
        ({middle: bare}, 1),
    )
    touched = sorted({sid for call in (outer, middle, inner) for sid in model.touched_storages(call)})
    return _signed_events(model, signed, touched)


def _signed_events(
    model: SegmentModel, signed_plans: tuple[tuple[Plan, int], ...], storages: list[int]
) -> list[tuple[Key, int]]:
    """The sum of each plan's events over ``storages`` and its bursts, times its sign."""
    items: list[tuple[Key, int]] = []
    for plan, sign in signed_plans:
        _check_plan(model, plan)
        events = _Events(model, plan)
        for sid in storages:
            events.add_storage(model.profile.storages[sid])
        for call in plan:
            events.add_burst(call)
        items += [(key, sign * delta) for key, delta in events.items]
    return items


def keep_delta_events(model: SegmentModel, call: int, op: int) -> list[tuple[Key, int]]:
    """``memory_events({call: {op}})`` minus ``memory_events({call: set()})``: keeping one op's
    output moves only that output's events and drops its re-run from the burst."""
    _check_plan(model, {call: frozenset({op})})
    kept, bare = _Events(model, {call: frozenset({op})}), _Events(model, {call: frozenset()})
    for sid in model.outputs_by_op.get(op, ()):
        storage = model.profile.storages[sid]
        kept.add_storage(storage)
        bare.add_storage(storage)
    if model.segments[call].burst_pos is not None and op < model.segments[call].stop:
        bare.add_rerun(call, op)
    return kept.items + [(key, -delta) for key, delta in bare.items]


def burst_key(model: SegmentModel, frame: Frame, op: int, sub: int) -> Key:
    """Event key of op ``op`` inside ``frame``'s recompute burst."""
    return (frame.burst_pos if frame.burst_pos is not None else model.end, 1, *frame.order, op, sub)


def simulate(
    profile: Profile,
    plan: Plan,
    *,
    model: SegmentModel | None = None,
    variants: Variants = frozenset(),
    timeline: bool = False,
) -> SimResult:
    model = model or SegmentModel(profile)
    events = _events(model, plan, variants)
    counted = _counted_peak(profile, events)  # before the sweep sorts the events
    peak, peak_key, points = _sweep(events.items, timeline)
    frames = events.frames
    recompute_ms = sum((model.recompute_ms(call, kept, frames[call]) for call, kept in plan.items()), 0.0)
    added_ms = sum((model.added_ms(call, kept, frames[call]) for call, kept in plan.items()), 0.0)
    added_ms += profile.overheads.first_frame_ms if plan else 0.0
    added_ms += sum((model.profile.variants[v].time_ms for v in variants), 0.0)
    checks_ms = profile.overheads.checks_ms  # every applied schedule runs them, the empty one too
    added_ms += checks_ms
    return SimResult(
        peak_bytes=peak if counted is None else counted,
        requested_peak_bytes=peak,
        peak_pos=max(peak_key[0], 0),
        step_ms=profile.baseline.step_ms + added_ms,
        recompute_ms=recompute_ms,
        added_ms=added_ms,
        checks_ms=checks_ms,
        timeline=points,
    )


def _check_variants(model: SegmentModel, plan: Plan, variants: Variants) -> None:
    for index in variants:
        if not 0 <= index < len(model.profile.variants):
            raise ValueError(f"variant {index} is not a variant of this profile")
        clash = [call for call in model.variant_conflicts[index] if call in plan]
        if clash:
            site = model.profile.variants[index]
            raise ValueError(
                f"the variant at {site.module!r} and segment {model.segments[clash[0]].fqn!r} change the same tensors"
            )
    for a, b in combinations(sorted(variants), 2):
        if (a, b) in model.variant_clashes:
            sites = model.profile.variants
            raise ValueError(f"the variants at {sites[a].module!r} and {sites[b].module!r} change the same tensors")


def _check_plan(model: SegmentModel, plan: Plan) -> None:
    calls = list(plan)
    for call in calls:
        if call not in model.segments:
            raise ValueError(f"call {call} is not a checkpointable segment of this profile")
        extra = plan[call] - set(model.segments[call].candidates)
        if extra:
            raise ValueError(f"segment {model.segments[call].fqn!r} cannot keep ops {sorted(extra)}")
    problem = nesting_problem(model, plan)
    if problem:
        raise ValueError(problem)


def nesting_problem(model: SegmentModel, plan: Plan) -> str:
    """Why ``plan``'s overlapping segments cannot run as nested checkpoints ("" if they can):
    each segment inside another chosen one must be a nest pair with the nearest of them,
    neither keeping anything, at most ``NEST_LEVELS`` deep."""
    pairs = set(model.nest_pairs)
    for a, b in model.crossing_pairs:
        if a in plan and b in plan:
            return f"segments {model.segments[a].fqn!r} and {model.segments[b].fqn!r} overlap"
    for call in plan:
        chosen = [a for a in model.ancestors[call][1:] if a in plan]
        if not chosen:
            continue
        names = f"{model.segments[chosen[0]].fqn!r} and {model.segments[call].fqn!r}"
        if (chosen[0], call) not in pairs or plan[chosen[0]] or plan[call]:
            return f"segments {names} overlap"
        if len(chosen) >= NEST_LEVELS:
            return f"segments {names} nest deeper than {NEST_LEVELS} levels"
    return ""


class _Events:
    """Collects (key, +/-bytes) memory events for one plan."""

    def __init__(self, model: SegmentModel, plan: Plan) -> None:
        self.model = model
        self.plan = plan
        self.end = model.end
        self.items: list[tuple[Key, int]] = []
        self.owners: list[tuple[int, bool]] = []
        """For each item: (storage id, whether it is a recomputed copy or transient)."""
        self.frames = model.frames(plan)
        self.pack_owner = model.chosen_segment_of_pack(plan)
        self.op_owner = model.chosen_segment_of_op(plan)
        self.frame_holds = self._frame_holds()
        self.nested_inputs: dict[int, list[int]] = defaultdict(list)
        """Storage -> the nested segments that take it as an argument."""
        for frame in self.frames.values():
            if frame.outer is not None:
                for sid in model.calls[frame.call].inputs:
                    self.nested_inputs[sid].append(frame.call)
        self.copy_free: dict[tuple[int, int], Key] = {}
        """(segment, storage) -> when the copy its recompute makes is freed, for the copies
        held after the burst (their allocation is placed by add_burst)."""

    def _frame_holds(self) -> dict[int, Key]:
        """Checkpoint keeps each outermost segment's tensor arguments until its saved tensors are released."""
        holds: dict[int, Key] = {}
        for frame in self.frames.values():
            if frame.outer is not None:
                continue
            end: Key = (frame.frame_end, 0)
            for sid in self.model.calls[frame.call].inputs:
                holds[sid] = max(holds.get(sid, end), end)
        return holds

    def span(self, alloc: Key, free: Key, nbytes: int, storage: int, recomputed: bool = False) -> None:
        self.items.append((alloc, nbytes))
        self.items.append((free, -nbytes))
        self.owners += [(storage, recomputed), (storage, recomputed)]

    def burst_key(self, call: int, op: int, sub: int) -> Key:
        return burst_key(self.model, self.frames[call], op, sub)

    def burst_end(self, call: int) -> Key:
        return self.burst_key(call, self.frames[call].stop, 0)

    def add_storage(self, s: StorageRecord) -> None:
        alloc: Key = (s.alloc, 2) if s.producer is not None or s.alloc > 0 else BEFORE_STEP
        baseline_free: Key = (self.end if s.free is None else s.free, 0)
        if s.kind != "activation" or s.producer is None:
            self.span(alloc, baseline_free, s.bytes, s.id)
            return
        owner = self.op_owner.get(s.producer)
        kept = owner is not None and s.producer in self.plan[owner]
        packs = self.model.packs_by_storage.get(s.id, [])
        if not kept and not any(p in self.pack_owner for p in packs) and s.id not in self.nested_inputs:
            free = baseline_free
        else:
            free = self._original_free(s, owner, kept, packs, baseline_free)
        if s.id in self.frame_holds:
            free = max(free, self.frame_holds[s.id])
        self.span(alloc, free, s.bytes, s.id)

    def _original_free(
        self, s: StorageRecord, owner: int | None, kept: bool, packs: list[int], baseline_free: Key
    ) -> Key:
        python_end: Key = baseline_free if s.free_no_autograd is None else (s.free_no_autograd, 0)
        holds: list[Key] = [python_end]
        copy_holds: dict[int, list[Key]] = defaultdict(list)
        for p in packs:
            segment = self.pack_owner.get(p)
            release: Key = (self.model.release(p), 0)
            if segment is None:
                holds.append(release)
            elif not self.frames[segment].contains(s.producer):
                self._argument_hold(s, self.frames[segment], release, holds, copy_holds)
            elif segment == owner and kept:
                holds.append(release)  # kept: the cached original serves the saved use
            else:
                copy_holds[segment].append(release)
        for call in self.nested_inputs.get(s.id, ()):
            self._argument_hold(s, self.frames[call], None, holds, copy_holds)
            if call in self.model.members or call in self.model.ranges:
                # The checkpoint generator a chain drives holds its arguments until its last
                # call returns, and a range's tape what it read until it closes, though the
                # outer frame dropped what it saved of them.
                holds.append((self.frames[call].end_op, 0))
        if kept:
            holds.append(self.burst_end(owner))  # the selective policy's cache
        for segment, frees in copy_holds.items():
            if self.frames[segment].burst_pos is not None:
                self.copy_free[(segment, s.id)] = max(frees)
        return max(holds)

    def _argument_hold(
        self, s: StorageRecord, frame: Frame, release: Key | None, holds: list[Key], copy_holds: dict[int, list[Key]]
    ) -> None:
        """``s`` was made before ``frame``'s call, which took it as an argument (and saved it
        where ``release`` is given)."""
        outer = self._maker(frame, s.producer)
        if outer is None:
            # The outermost frame, which did not make it either, holds it until its backward is done.
            holds.append((self._outermost(frame).frame_end, 0))
            return
        # An enclosing frame that made it saved it for the calls inside: its recompute makes a
        # copy, which this call's recompute takes as an argument and saves again where it saved it.
        ends = [self.burst_end(frame.call)] + ([release] if release is not None else [])
        copy_holds[outer.call].append(max(ends))

    def _maker(self, frame: Frame, producer: int) -> Frame | None:
        """The nearest frame enclosing ``frame`` that runs op ``producer`` (None: none does)."""
        while frame.outer is not None:
            frame = self.frames[frame.outer]
            if frame.contains(producer):
                return frame
        return None

    def _outermost(self, frame: Frame) -> Frame:
        while frame.outer is not None:
            frame = self.frames[frame.outer]
        return frame

    def add_burst(self, call: int) -> None:
        frame = self.frames[call]
        if frame.burst_pos is None:
            return
        for op in range(frame.first_op, frame.stop):
            if op not in self.plan[call]:
                self.add_rerun(call, op)

    def add_workspaces(self) -> None:
        """Each op's workspace where the unscheduled step runs it (the same under any plan)."""
        profile = self.model.profile
        for pos, op in enumerate((*profile.ops, *profile.backward)):  # positions are consecutive
            if op.workspace_bytes:
                self.span((pos, 2), (pos + 1, 0), op.workspace_bytes, WORKSPACE)

    def add_rerun(self, call: int, op: int) -> None:
        """What op ``op`` makes again in segment ``call``'s recompute burst: its outputs and its workspace."""
        stop = self.frames[call].stop
        workspace = self.model.profile.ops[op].workspace_bytes
        if workspace:
            self.span(
                self.burst_key(call, op, 1), self.burst_key(call, op + 1, 0), workspace, WORKSPACE, recomputed=True
            )
        storages = self.model.profile.storages
        for sid in self.model.outputs_by_op.get(op, []):
            s = storages[sid]
            alloc = self.burst_key(call, op, 1)
            drop = self._burst_drop(call, s)
            if (call, sid) in self.copy_free:
                free = self.copy_free[(call, sid)]
            elif drop is not None and drop < stop:
                free = self.burst_key(call, drop, 0)
            else:
                free = self.burst_end(call)
            self.span(alloc, free, s.bytes, sid, recomputed=True)

    def _burst_drop(self, call: int, s: StorageRecord) -> int | None:
        """Where segment ``call``'s recompute drops its copy of ``s`` (None: when it ends). A
        call's forward drops what its Python drops; an op range's replay drops an entry's
        output after its last reader, though the forward's Python kept it longer."""
        python = s.free_no_autograd
        replay = self.model.replay_drop(call, s) if call in self.model.ranges else None
        if replay is None or python is None:
            return python if replay is None else replay
        return min(python, replay)


def _events(model: SegmentModel, plan: Plan, variants: Variants = frozenset()) -> _Events:
    _check_plan(model, plan)
    _check_variants(model, plan, variants)
    model = model.with_variants(frozenset(variants))
    events = _Events(model, plan)
    for storage in model.profile.storages:
        events.add_storage(storage)
    events.add_workspaces()
    for call in plan:
        events.add_burst(call)
    return events


def _counted_peak(profile: Profile, events: _Events) -> int | None:
    """The allocator's replayed peak where the profile's allocator leaves blocks unsplit, else
    None (the requests' sum is what it counts)."""
    if profile.device.type == "cuda" and leaves_blocks_unsplit(profile.device.alloc_conf):
        return _replayed_peak(events, profile.device.alloc_conf)
    return None


def _replayed_peak(events: _Events, alloc_conf: str) -> int:
    """The peak of ``events`` as PyTorch's native caching allocator counts it under
    ``alloc_conf`` (``core.allocator``): large blocks left unsplit count whole."""
    spans = [(alloc, free, nbytes) for (alloc, nbytes), (free, _) in zip(events.items[::2], events.items[1::2])]
    after = (events.end, 0)
    resident = [i for i, (alloc, free, _) in enumerate(spans) if alloc == BEFORE_STEP and free == after]
    return allocator_peak(spans, resident=resident, alloc_conf=alloc_conf)


def live_at_peak(model: SegmentModel, plan: Plan, variants: Variants = frozenset()) -> list[tuple[int, bool, int]]:
    """(storage id, recomputed copy?, bytes) of everything live at the simulated peak (storage
    ids of the profile as rewritten for ``variants``: their temporaries come after the others)."""
    return _live_at_peak(_events(model, plan, variants))


def _live_at_peak(events: _Events) -> list[tuple[int, bool, int]]:
    _, peak_key, _ = _sweep(list(events.items), False)
    live: dict[tuple[int, bool], int] = {}
    for (key, delta), owner in zip(events.items, events.owners):
        if key <= peak_key:
            live[owner] = live.get(owner, 0) + delta
    return [(sid, copy, nbytes) for (sid, copy), nbytes in live.items() if nbytes > 0]


def peak_breakdown(model: SegmentModel, plan: Plan, variants: Variants = frozenset()) -> dict[str, int]:
    """Live bytes per storage kind at the simulated peak of ``plan``; on CUDA, ``unsplit`` is what
    the allocator's blocks add at their own peak, so that the kinds add up to the peak."""
    storages = model.with_variants(frozenset(variants)).profile.storages
    events = _events(model, plan, variants)
    counted = _counted_peak(model.profile, events)
    totals: dict[str, int] = {}
    for sid, copy, nbytes in _live_at_peak(events):
        kind = "workspace" if sid == WORKSPACE else "recomputed" if copy else storages[sid].kind
        totals[kind] = totals.get(kind, 0) + nbytes
    requested = sum(totals.values())  # everything live at the requests' peak
    if counted is not None and counted > requested:
        totals["unsplit"] = counted - requested
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def _sweep(items: list[tuple[Key, int]], want_timeline: bool) -> tuple[int, Key, tuple[tuple[int, int], ...]]:
    items.sort(key=lambda item: item[0])
    current = peak = 0
    peak_key: Key = (0,)
    points: list[tuple[int, int]] = []
    last_pos = None
    for key, delta in items:
        current += delta
        if delta > 0 and current > peak:
            peak, peak_key = current, key
        if want_timeline and key[-1] != 0:
            if points and last_pos == key[0] and len(key) == 2:
                points[-1] = (key[0], max(points[-1][1], current))
            else:
                points.append((key[0], current))
            last_pos = key[0]
    return peak, peak_key, tuple(points)
