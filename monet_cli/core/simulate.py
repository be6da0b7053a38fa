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
  saved tensor is released (checkpoint holds its inputs).

Event keys are tuples so plain ordering puts, at position t: frees before op t
``(t, 0)``, then a recompute burst ``(t, 1, segment, op, sub)``, then op t's
allocations ``(t, 2)``.
"""

from __future__ import annotations

from dataclasses import dataclass

from monet_cli.core.profile import Profile, StorageRecord
from monet_cli.core.segments import SegmentModel

Plan = dict[int, frozenset[int]]
"""Chosen segments: module call index -> op indices whose outputs are kept."""

Key = tuple[int, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class SimResult:
    peak_bytes: int
    peak_pos: int
    step_ms: float
    recompute_ms: float
    """Profiled time of the ops the schedule re-runs."""
    added_ms: float
    """recompute_ms plus the checkpoint machinery: step_ms - baseline step_ms."""
    timeline: tuple[tuple[int, int], ...] = ()
    """(position, live bytes after that position's allocations), if requested."""


def memory_events(model: SegmentModel, plan: Plan) -> list[tuple[Key, int]]:
    """Every (key, +/- bytes) memory event of the step under ``plan``, unsorted."""
    return _events(model, plan).items


def segment_delta_events(model: SegmentModel, call: int, kept: frozenset[int]) -> list[tuple[Key, int]]:
    """``memory_events({call: kept})`` minus ``memory_events({})``, computed from the storages
    that checkpointing ``call`` can move (the others cancel): what the solver's linear model
    needs for every segment and keep, without simulating the whole step each time."""
    plan = {call: kept}
    _check_plan(model, plan)
    chosen, empty = _Events(model, plan), _Events(model, {})
    for sid in model.touched_storages(call):
        storage = model.profile.storages[sid]
        chosen.add_storage(storage)
        empty.add_storage(storage)
    chosen.add_burst(call)
    return chosen.items + [(key, -delta) for key, delta in empty.items]


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


def burst_key(model: SegmentModel, call: int, op: int, sub: int) -> Key:
    """Event key of op ``op`` inside segment ``call``'s recompute burst."""
    seg = model.segments[call]
    # Later segments run their backward first; order bursts at one position that way.
    return (seg.burst_pos if seg.burst_pos is not None else model.end, 1, -seg.first_op, op, sub)


def simulate(profile: Profile, plan: Plan, *, model: SegmentModel | None = None, timeline: bool = False) -> SimResult:
    model = model or SegmentModel(profile)
    peak, peak_key, points = _sweep(memory_events(model, plan), timeline)
    recompute_ms = sum((model.recompute_ms(call, kept) for call, kept in plan.items()), 0.0)
    added_ms = sum((model.added_ms(call, kept) for call, kept in plan.items()), 0.0)
    return SimResult(
        peak_bytes=peak,
        peak_pos=max(peak_key[0], 0),
        step_ms=profile.baseline.step_ms + added_ms,
        recompute_ms=recompute_ms,
        added_ms=added_ms,
        timeline=points,
    )


def _check_plan(model: SegmentModel, plan: Plan) -> None:
    calls = list(plan)
    for call in calls:
        if call not in model.segments:
            raise ValueError(f"call {call} is not a checkpointable segment of this profile")
        extra = plan[call] - set(model.segments[call].candidates)
        if extra:
            raise ValueError(f"segment {model.segments[call].fqn!r} cannot keep ops {sorted(extra)}")
    for i, a in enumerate(calls):
        for b in calls[i + 1:]:
            if model.overlaps(a, b):
                raise ValueError(f"segments {model.segments[a].fqn!r} and {model.segments[b].fqn!r} overlap")


class _Events:
    """Collects (key, +/-bytes) memory events for one plan."""

    def __init__(self, model: SegmentModel, plan: Plan) -> None:
        self.model = model
        self.plan = plan
        self.end = model.end
        self.items: list[tuple[Key, int]] = []
        self.owners: list[tuple[int, bool]] = []
        """For each item: (storage id, whether it is a recomputed copy or transient)."""
        self.pack_owner = model.chosen_segment_of_pack(plan)
        self.op_owner = model.chosen_segment_of_op(plan)
        self.frame_holds = self._frame_holds()
        self.copies: set[int] = set()
        """Storages whose recomputed copy is held after the burst (alloc placed by add_burst)."""
        self.copy_free: dict[int, Key] = {}

    def _frame_holds(self) -> dict[int, Key]:
        """Checkpoint keeps each segment's tensor arguments until its saved tensors are released."""
        holds: dict[int, Key] = {}
        for call in self.plan:
            end: Key = (self.model.segments[call].frame_end, 0)
            for sid in self.model.profile.calls[call].inputs:
                holds[sid] = max(holds.get(sid, end), end)
        return holds

    def span(self, alloc: Key, free: Key, nbytes: int, storage: int = -1, recomputed: bool = False) -> None:
        self.items.append((alloc, nbytes))
        self.items.append((free, -nbytes))
        self.owners += [(storage, recomputed), (storage, recomputed)]

    def burst_key(self, call: int, op: int, sub: int) -> Key:
        return burst_key(self.model, call, op, sub)

    def burst_end(self, call: int) -> Key:
        return self.burst_key(call, self.model.segments[call].stop, 0)

    def add_storage(self, s: StorageRecord) -> None:
        alloc: Key = (s.alloc, 2) if s.producer is not None or s.alloc > 0 else (-1, 2)
        baseline_free: Key = (self.end if s.free is None else s.free, 0)
        if s.kind != "activation" or s.producer is None:
            self.span(alloc, baseline_free, s.bytes, s.id)
            return
        owner = self.op_owner.get(s.producer)
        kept = owner is not None and s.producer in self.plan[owner]
        packs = self.model.packs_by_storage.get(s.id, [])
        if not kept and not any(p in self.pack_owner for p in packs):
            free = baseline_free
        else:
            free = self._original_free(s, owner, kept, packs, baseline_free)
        if s.id in self.frame_holds:
            free = max(free, self.frame_holds[s.id])
        self.span(alloc, free, s.bytes, s.id)

    def _original_free(self, s: StorageRecord, owner: int | None, kept: bool, packs: list[int], baseline_free: Key) -> Key:
        python_end: Key = baseline_free if s.free_no_autograd is None else (s.free_no_autograd, 0)
        holds: list[Key] = [python_end]
        copy_holds: list[Key] = []
        for p in packs:
            segment = self.pack_owner.get(p)
            release: Key = (self.model.release(p), 0)
            if segment is None:
                holds.append(release)
            elif segment == owner and not kept:
                copy_holds.append(release)
            elif segment == owner:
                holds.append(release)  # kept: the cached original serves the saved use
            else:
                # Made outside the segment that saved it: checkpoint holds it as an input.
                holds.append((self.model.segments[segment].frame_end, 0))
        if kept:
            holds.append(self.burst_end(owner))  # the selective policy's cache
        if copy_holds and self.model.segments[owner].burst_pos is not None:
            self.copies.add(s.id)
            self.copy_free[s.id] = max(copy_holds)
        return max(holds)

    def add_burst(self, call: int) -> None:
        seg = self.model.segments[call]
        if seg.burst_pos is None:
            return
        for op in range(seg.first_op, seg.stop):
            if op not in self.plan[call]:
                self.add_rerun(call, op)

    def add_rerun(self, call: int, op: int) -> None:
        """The outputs op ``op`` makes again in segment ``call``'s recompute burst."""
        seg = self.model.segments[call]
        storages = self.model.profile.storages
        for sid in self.model.outputs_by_op.get(op, []):
            s = storages[sid]
            alloc = self.burst_key(call, op, 1)
            if sid in self.copies:
                free = self.copy_free[sid]
            elif s.free_no_autograd is not None and s.free_no_autograd < seg.stop:
                free = self.burst_key(call, s.free_no_autograd, 0)
            else:
                free = self.burst_end(call)
            self.span(alloc, free, s.bytes, sid, recomputed=True)


def _events(model: SegmentModel, plan: Plan) -> _Events:
    _check_plan(model, plan)
    events = _Events(model, plan)
    for storage in model.profile.storages:
        events.add_storage(storage)
    for call in plan:
        events.add_burst(call)
    return events


def live_at_peak(model: SegmentModel, plan: Plan) -> list[tuple[int, bool, int]]:
    """(storage id, recomputed copy?, bytes) of everything live at the simulated peak."""
    events = _events(model, plan)
    _, peak_key, _ = _sweep(list(events.items), False)
    live: dict[tuple[int, bool], int] = {}
    for (key, delta), owner in zip(events.items, events.owners):
        if key <= peak_key:
            live[owner] = live.get(owner, 0) + delta
    return [(sid, copy, nbytes) for (sid, copy), nbytes in live.items() if nbytes > 0]


def peak_breakdown(model: SegmentModel, plan: Plan) -> dict[str, int]:
    """Live bytes per storage kind at the simulated peak of ``plan``."""
    storages = model.profile.storages
    totals: dict[str, int] = {}
    for sid, copy, nbytes in live_at_peak(model, plan):
        kind = "recomputed" if copy else storages[sid].kind
        totals[kind] = totals.get(kind, 0) + nbytes
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
