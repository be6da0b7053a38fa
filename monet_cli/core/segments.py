"""What checkpointing one module call would change, derived from a profile.

A segment is a module call run under non-reentrant ``torch.utils.checkpoint``. In the
forward, autograd keeps nothing it saves inside the segment (unless a selective policy
keeps an op's output). In backward, the first node that needs one of its saved tensors
re-runs the segment from its first op up to the op that made the last saved tensor
(checkpoint stops early there): one recompute burst per segment.

A segment is either one module call or a chain of sibling calls (``sibling_chains``): leaf
modules the parent calls one after another, each passing its one tensor to the next, such as
a ResNet's stem (conv1, bn1, relu, maxpool). The chain runs under one checkpoint, so its
frame saves only the first call's arguments, where each call alone would save its own.

A segment may also be an op range (``core/ranges.py``): a stretch of one module's forward
from one of its calls (or its start) to a later one (or its end), its own code included.

A segment may hold nested segments (recursive checkpointing, up to ``NEST_LEVELS`` deep, an
outer holding several inner ones): the outer frame then saves each inner call's arguments
instead of what the inner call saves, so its recompute stops at the last inner call's start
when nothing later is saved, and each inner segment's recompute takes its arguments from
the outer one's.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from itertools import combinations

import numpy as np

from monet_cli.core.offload import with_offload_sites
from monet_cli.core.profile import ModuleCall, Profile, StorageRecord
from monet_cli.core.ranges import OpRange, calls_made, op_ranges, packs_inside
from monet_cli.core.variants import changed_storages, innermost_calls, with_variants

# Ops selective checkpointing never caches (torch.utils.checkpoint.SAC_IGNORED_OPS),
# written out here so the core stays free of torch.
SAC_IGNORED_OPS = frozenset(
    {
        "aten.detach.default",
        "prim.device.default",
        "aten.size.default",
        "aten.stride.default",
        "aten.numel.default",
        "aten.dim.default",
        "aten.is_contiguous.default",
    }
)


VARIANT_MODELS_CACHED = 8
"""Variant sets whose rewritten profile ``SegmentModel.with_variants`` keeps (a solve checks a few)."""

NEST_LEVELS = 3
"""Chosen segments nest at most this deep: a stage holding a block holding a branch. The
solver models it with nest pairs and triples (``nest_triples``); a fourth level would need
a family of its own."""

MAX_NESTED_CHILDREN = 8
"""A segment with more sub-segments than this (a stack of layers) holds none nested. On
resnet50 (batch 32, 128 px) 12 found the same smallest peak three deep as 8, and a 50% solve
took 50 s instead of 42 s (one profile, before the overlap constraints were tightened)."""


CHAIN = "chain"
"""The ``type`` of a chain's call record (``SegmentModel.calls``)."""

RANGE = "range"
"""The ``type`` of an op range's call record."""


def sibling_chains(profile: Profile) -> list[tuple[ModuleCall, ...]]:
    """Runs of two or more sibling leaf calls (modules with no sub-calls) that their parent
    makes one after another with no op between them, each after the first called with the
    output of the one before alone, and whose ops' outputs nothing after the next call reads. Runs
    that are all of their parent's forward are left out: the parent is that segment already."""
    calls = profile.calls
    has_children = {c.parent for c in calls}
    by_parent: dict[int, list[ModuleCall]] = defaultdict(list)
    for call in calls:
        if call.parent is not None:
            by_parent[call.parent].append(call)

    def member(call: ModuleCall) -> bool:  # the chain's recompute calls it, hooks and all
        return call.checkpointable and not call.hooks_reason and call.index not in has_children

    chains: list[tuple[ModuleCall, ...]] = []
    for parent, children in by_parent.items():
        whole = (calls[parent].first_op, calls[parent].end_op)
        chains += [run for run in _runs(profile, children, member) if (run[0].first_op, run[-1].end_op) != whole]
    return sorted(chains, key=lambda run: run[0].first_op)


def _runs(
    profile: Profile, children: list[ModuleCall], member: Callable[[ModuleCall], bool]
) -> list[tuple[ModuleCall, ...]]:
    """The runs of two or more ``member`` calls among siblings, each passing on to the next."""
    runs: list[tuple[ModuleCall, ...]] = []
    run: list[ModuleCall] = []
    for call in sorted(children, key=lambda c: c.first_op):
        if run and member(call) and _passes_on(profile, run, call):
            run.append(call)
            continue
        if len(run) >= 2:
            runs.append(tuple(run))
        run = [call] if member(call) else []
    if len(run) >= 2:
        runs.append(tuple(run))
    return runs


def _passes_on(profile: Profile, run: list[ModuleCall], call: ModuleCall) -> bool:
    """Whether ``call`` can follow ``run`` in a chain: it starts where the run's last call
    ended, it was called with that call's output alone (``ModuleCall.hand_off``: the chain's
    recompute hands it on so, and the executor refuses a forward that does otherwise), and what
    the last call made is read by nothing after ``call``."""
    last = run[-1]
    if call.first_op != last.end_op or not call.hand_off:
        return False
    return all(reader < call.end_op for op in profile.ops[last.first_op : last.end_op] for reader in op.consumers)


@dataclass(frozen=True, kw_only=True, slots=True)
class SegmentInfo:
    call: int
    fqn: str
    members: tuple[str, ...]
    """A chain's module paths, in call order (empty: the segment is the module call ``fqn``)."""
    first_op: int
    end_op: int
    packs: tuple[int, ...]
    """Indices of the profile's packs made inside the call."""
    stop: int
    """Recompute re-runs ops first_op..stop-1."""
    burst_pos: int | None
    """Backward position where recompute happens (first unpack); None: never needed."""
    frame_end: int
    """Position by which autograd released every tensor saved inside the call."""
    candidates: tuple[int, ...]
    """Ops whose outputs a selective policy may keep (saved, never mutated, not in-place;
    none in an op range, whose recompute replays ops outside checkpoint's policy)."""
    range: OpRange | None = None
    """Set when the segment is an op range."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Frame:
    """A chosen segment as it runs under one plan (nesting changes the outer one's recompute)."""

    call: int
    first_op: int
    end_op: int
    stop: int
    burst_pos: int | None
    frame_end: int
    saves: int
    """Tensors saved through this frame's hooks: its own saves and nested calls' arguments."""
    recorded_again: int
    """Own ops of a nested op range that this frame's recompute runs, and so records, again."""
    outer: int | None
    """The chosen segment this one is nested in."""
    order: tuple[int, int]
    """(-first op of the outermost frame, nesting depth): the order of bursts at one backward
    position. Later segments run their backward first; an outer recompute runs before its
    inner one, which takes its arguments from it."""

    def contains(self, op: int) -> bool:
        return self.first_op <= op < self.end_op


class SegmentModel:
    """Per-call segment facts for one profile, computed once."""

    def __init__(
        self,
        profile: Profile,
        *,
        offer_offloads: bool = True,
        offer_ranges: bool = True,
        like: SegmentModel | None = None,
    ) -> None:
        self.profile = with_offload_sites(profile) if offer_offloads else profile
        """The profile, with the offloads it offers among its variants (``core/offload.py``)."""
        profile = self.profile
        self.end = profile.num_positions
        self.calls: tuple[ModuleCall, ...]
        """The profile's calls, then one record per sibling chain (type ``CHAIN``, named
        'first..last'), then one per op range (type ``RANGE``, named 'module[first op:end op]')."""
        self.members: dict[int, tuple[int, ...]]
        """Each chain's calls."""
        self.ranges: dict[int, OpRange]
        if like is not None:
            # A model of the profile rewritten for operator variants: a plan's call indices
            # must name the same segments in both, so they are not derived again.
            self.calls, self.members, self.ranges = like.calls, like.members, like.ranges
        else:
            self.calls, self.members = _with_chains(profile)
            self.calls, self.ranges = (
                _with_ranges(profile, self.calls, self.members) if offer_ranges else (self.calls, {})
            )
        self._variant_models: dict[frozenset[int], SegmentModel] = {}
        self._stretch_scales: dict[int, tuple[float, ...]] = {}

    def with_variants(self, chosen: frozenset[int]) -> SegmentModel:
        """The model of this profile as if the operator variants ``chosen`` had run."""
        if not chosen:
            return self
        if chosen not in self._variant_models:
            if len(self._variant_models) >= VARIANT_MODELS_CACHED:
                self._variant_models.pop(next(iter(self._variant_models)))
            self._variant_models[chosen] = SegmentModel(
                with_variants(self.profile, chosen), offer_offloads=False, like=self
            )
        return self._variant_models[chosen]

    @cached_property
    def variant_storages(self) -> dict[int, tuple[int, ...]]:
        """Variant index -> the profile's storages whose lifetime it can change."""
        owner = innermost_calls(self.profile)
        return {index: changed_storages(self.profile, site, owner) for index, site in enumerate(self.profile.variants)}

    @cached_property
    def variant_conflicts(self) -> dict[int, tuple[int, ...]]:
        """Variant index -> the segments it cannot run with: checkpointing them would move the
        same storages (so neither one's effect could be added to the other's), or, for an
        offload, would run a checkpoint frame inside its call or around it (the frame's hooks
        and the offload's would take each other's saves)."""
        touched = {call: set(self.touched_storages(call)) for call in self.segments}
        conflicts = {}
        for index, ids in self.variant_storages.items():
            site = self.profile.variants[index]
            first, end = site.ops[0], site.ops[-1] + 1
            conflicts[index] = tuple(
                call
                for call, storages in touched.items()
                if storages.intersection(ids)
                or site.impl == "offload"
                and self.segments[call].first_op < end
                and first < self.segments[call].end_op
            )
        return conflicts

    @cached_property
    def variant_clashes(self) -> frozenset[tuple[int, int]]:
        """Pairs of variants that cannot run together: they change the same storages or ops
        (an offload's ops are every op of its call)."""
        changed = [
            (frozenset(self.variant_storages[i]), frozenset(site.ops)) for i, site in enumerate(self.profile.variants)
        ]
        return frozenset(
            (a, b)
            for a, b in combinations(range(len(changed)), 2)
            if not changed[a][0].isdisjoint(changed[b][0]) or not changed[a][1].isdisjoint(changed[b][1])
        )

    @cached_property
    def ancestors(self) -> list[tuple[int, ...]]:
        """For each call (chains included): itself and its enclosing calls, innermost first.
        A chain encloses its members."""
        parent = {call.index: call.parent for call in self.calls}
        for chain, members in self.members.items():
            parent.update(dict.fromkeys(members, chain))
        chains: list[tuple[int, ...]] = [()] * len(self.calls)
        for call in sorted(self.calls, key=lambda c: (c.first_op, -c.end_op, c.index)):  # enclosing ones first
            if call.index in self.ranges:
                continue
            up = parent[call.index]
            chains[call.index] = (call.index,) + (chains[up] if up is not None else ())
        # A range encloses what runs inside its calls; ranges of one parent cross each other
        # rather than nest (``crossing_pairs``).
        for index, r in self.ranges.items():
            for inside in range(len(chains)):
                enclosing = chains[inside]
                if (
                    inside not in self.ranges
                    and r.parent in enclosing[1:]
                    and r.first_op <= self.calls[inside].first_op
                    and self.calls[inside].end_op <= r.end_op
                ):
                    at = enclosing.index(r.parent)
                    chains[inside] = enclosing[:at] + (index,) + enclosing[at:]
        for index, r in self.ranges.items():
            chains[index] = (index,) + chains[r.parent]
        return chains

    @cached_property
    def packs_by_call(self) -> dict[int, list[int]]:
        """Packs made inside each call, including its sub-calls."""
        by_call: dict[int, list[int]] = defaultdict(list)
        made_in: dict[int, list[int]] = defaultdict(list)  # packs made in the call itself, not in a sub-call
        for index, pack in enumerate(self.profile.packs):
            if pack.call is not None:
                made_in[pack.call].append(index)
                for call in self.ancestors[pack.call]:
                    if call not in self.ranges:
                        by_call[call].append(index)
        for index, r in self.ranges.items():
            by_call[index] = packs_inside(self.profile, r, by_call, made_in[r.parent])
        return by_call

    @cached_property
    def crossing_pairs(self) -> tuple[tuple[int, int], ...]:
        """Segments whose ops overlap while neither encloses the other (two ranges of one
        parent, a range and a chain): never chosen together."""
        ordered = sorted(self.segments.values(), key=lambda seg: (seg.first_op, -seg.end_op))
        pairs = []
        for k, a in enumerate(ordered):
            for b in ordered[k + 1 :]:
                if b.first_op >= a.end_op:
                    break
                if a.call not in self.ancestors[b.call] and b.call not in self.ancestors[a.call]:
                    pairs.append((a.call, b.call))
        return tuple(pairs)

    @cached_property
    def sharing_sets(self) -> tuple[tuple[int, ...], ...]:
        """The largest sets of segments that share an op. Overlapping segments are only chosen
        nested, so of each set at most one chosen segment is outermost: a clique that keeps
        CP-SAT's relaxation from choosing fractions of overlapping segments side by side."""
        segs = [seg for seg in self.segments.values() if seg.first_op < seg.end_op]
        calls = np.array([seg.call for seg in segs], dtype=np.int64)
        first = np.array([seg.first_op for seg in segs], dtype=np.int64)
        end = np.array([seg.end_op for seg in segs], dtype=np.int64)
        starts = np.unique(first)
        sets = []
        # A set only grows where a segment starts, so the largest ones are found there: the
        # set at one start is kept unless all of it still runs at the next start.
        for k, at in enumerate(starts):
            inside = (first <= at) & (at < end)
            if k + 1 < len(starts) and end[inside].min() > starts[k + 1]:
                continue
            if inside.sum() > 1:
                sets.append(tuple(sorted(calls[inside].tolist())))
        return tuple(sets)

    @cached_property
    def packs_by_storage(self) -> dict[int, list[int]]:
        by_storage: dict[int, list[int]] = defaultdict(list)
        for index, pack in enumerate(self.profile.packs):
            by_storage[pack.storage].append(index)
        return by_storage

    @cached_property
    def outputs_by_op(self) -> dict[int, list[int]]:
        """Activation storages each forward op allocated."""
        outputs: dict[int, list[int]] = defaultdict(list)
        for storage in self.profile.storages:
            if storage.kind == "activation" and storage.producer is not None:
                outputs[storage.producer].append(storage.id)
        return outputs

    def replay_drop(self, range_call: int, storage: StorageRecord) -> int | None:
        """Where op range ``range_call``'s replay drops its copy of ``storage``, made by an op
        it re-runs: once the last entry reading it returns, the entry that made it included.
        An entry is a call the range makes or a torch call of its module's own code; the replay
        holds what an entry returned to that code (``StorageRecord.returned_to``) and nothing
        else: its own Python does not run, so what that code kept on the module is kept only
        by the forward's tensor, and a call that keeps what it makes runs in no range
        (``ModuleCall.checkpointable``). None: the replay does not hold it (an entry's own
        locals, freed where the profile saw them freed), or the profile predates the records
        this needs."""
        ops = self.profile.ops
        op, holder = storage.producer, storage.returned_to
        r = self.ranges[range_call]
        if op is None or holder is None or ops[op].torch_call_end is None or not self._holds(r.parent, holder):
            return None
        return max(self._entry_end(r, reader) for reader in (op, *ops[op].consumers) if reader < r.end_op)

    def _holds(self, call: int | None, returned_to: int) -> bool:
        """Whether ``call``'s own code held a tensor last handed to ``returned_to``'s: the
        tensor went up from call to caller, so the calls that held it are ``returned_to`` and
        those below it."""
        while call is not None and call != returned_to:
            call = self.profile.calls[call].parent
        return call is not None

    def _entry_end(self, r: OpRange, op: int) -> int:
        for index in r.calls:
            call = self.profile.calls[index]
            if call.first_op <= op < call.end_op:
                return call.end_op
        return self.profile.ops[op].torch_call_end  # type: ignore[return-value]

    def release(self, pack_index: int) -> int:
        release = self.profile.packs[pack_index].release
        return self.end if release is None else release

    @cached_property
    def segments(self) -> dict[int, SegmentInfo]:
        """Every checkpointable call that autograd saves something inside."""
        return {
            call.index: self._segment(call.index)
            for call in self.calls
            if call.checkpointable and self.packs_by_call.get(call.index)
        }

    def _segment(self, call_index: int) -> SegmentInfo:
        call = self.calls[call_index]
        packs = tuple(self.packs_by_call[call_index])
        unpacks = [self.profile.packs[i].unpack for i in packs if self.profile.packs[i].unpack is not None]
        return SegmentInfo(
            call=call_index,
            fqn=call.fqn,
            members=tuple(self.calls[m].fqn for m in self.members.get(call_index, ())),
            first_op=call.first_op,
            end_op=call.end_op,
            packs=packs,
            stop=max(self.profile.packs[i].pos for i in packs),
            burst_pos=min(unpacks) if unpacks else None,
            frame_end=max(self.release(i) for i in packs),
            candidates=() if call_index in self.ranges else self._keep_candidates(call.first_op, call.end_op, packs),
            range=self.ranges.get(call_index),
        )

    def _keep_candidates(self, first: int, end: int, packs: tuple[int, ...]) -> tuple[int, ...]:
        saved_inside = {self.profile.packs[i].storage for i in packs}
        candidates = []
        for index in range(first, end):
            op = self.profile.ops[index]
            if op.inplace_of is not None or op.op in SAC_IGNORED_OPS:
                continue
            outputs = [self.profile.storages[s] for s in self.outputs_by_op.get(index, [])]
            if any(s.id in saved_inside for s in outputs) and not any(s.mutated for s in outputs):
                candidates.append(index)
        return tuple(candidates)

    @cached_property
    def nest_pairs(self) -> tuple[tuple[int, int], ...]:
        """(outer, inner): each segment with the nearest enclosing segment, which may hold it
        nested, and with the nearest enclosing op range (ranges sit between a call and its
        parent, so the parent keeps its pair). Both must be recomputed at some point (a
        recompute that never runs nests nothing). Nearest only, and outers of at most
        ``MAX_NESTED_CHILDREN`` segments (a layer holding its attention, not a stack of layers
        holding one): the pairs grow with the number of segments, and each pair's rows with
        its outer's size, not the model's. An inner segment that saves only its arguments (a
        Linear) is left out: nested, the outer would save the same tensors for it, and its
        recompute would only add time. A range may be the inner one when it opens where its
        module's forward opens; nested, it saves what it read through the outer frame when
        it closes (``core/ranges.py``)."""
        bursting = {c for c, seg in self.segments.items() if seg.burst_pos is not None}
        candidates = []
        for inner in sorted(bursting - self._late_ranges):
            enclosing = [a for a in self.ancestors[inner][1:] if a in self.segments]
            for ranges in (False, True):
                outer = next((a for a in enclosing if (a in self.ranges) == ranges), None)
                if outer in bursting:
                    candidates.append((outer, inner))
        children: dict[int, int] = defaultdict(int)
        for outer, _ in candidates:
            children[outer] += 1
        return tuple(
            sorted(
                (outer, inner)
                for outer, inner in candidates
                if children[outer] <= MAX_NESTED_CHILDREN and self._saves_what_it_makes(inner)
            )
        )

    @cached_property
    def pair_frames(self) -> dict[tuple[int, int], dict[int, Frame]]:
        """Each nest pair's two frames as they run nested (the solver's costs and points)."""
        return {
            (outer, inner): self.frames({outer: frozenset(), inner: frozenset()}) for outer, inner in self.nest_pairs
        }

    @cached_property
    def _pairs_by_outer(self) -> dict[int, tuple[tuple[int, int], ...]]:
        by_outer: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for pair in self.nest_pairs:
            by_outer[pair[0]].append(pair)
        return {outer: tuple(pairs) for outer, pairs in by_outer.items()}

    def nest_pairs_of(self, outer: int) -> tuple[tuple[int, int], ...]:
        """The nest pairs whose outer segment is ``outer``."""
        return self._pairs_by_outer.get(outer, ())

    def between(self, outer: int, inner: int) -> tuple[int, ...]:
        """The segments between ``inner`` and ``outer``, which encloses it: with one of them
        chosen, ``inner`` is not nested directly in ``outer``."""
        enclosing = self.ancestors[inner]
        return tuple(a for a in enclosing[1 : enclosing.index(outer)] if a in self.segments)

    @cached_property
    def nestable(self) -> frozenset[tuple[int, int]]:
        """(outer, inner) of every two segments that may both be chosen, one inside the other:
        a nest pair, or the ends of a nest triple."""
        return frozenset(self.nest_pairs) | frozenset((outer, inner) for outer, _, inner in self.nest_triples)

    @cached_property
    def nest_triples(self) -> tuple[tuple[int, int, int], ...]:
        """(outer, middle, inner): two nest pairs sharing the middle segment, three levels deep."""
        return tuple(
            (outer, middle, inner) for outer, middle in self.nest_pairs for _, inner in self.nest_pairs_of(middle)
        )

    @cached_property
    def triple_frames(self) -> dict[tuple[int, int, int], dict[int, Frame]]:
        """Each nest triple's three frames as they run nested."""
        return {triple: self.frames(dict.fromkeys(triple, frozenset())) for triple in self.nest_triples}

    @cached_property
    def _late_ranges(self) -> frozenset[int]:
        """Op ranges that open after their module's forward starts: never an inner segment.
        Offered (with outers of up to 24 sub-segments), they doubled resnet50's nest pairs
        (223 to 418) and a 50% solve's time (21 to 41 s), and lowered the smallest peak of no
        workload of ``bench/reach.py``."""
        return frozenset(c for c, r in self.ranges.items() if r.first_op != self.calls[r.parent].first_op)

    def _saves_what_it_makes(self, call_index: int) -> bool:
        seg = self.segments[call_index]
        producers = (self.profile.storages[self.profile.packs[p].storage].producer for p in seg.packs)
        return any(producer is not None and seg.first_op <= producer < seg.end_op for producer in producers)

    def frames(self, plan: dict[int, frozenset[int]]) -> dict[int, Frame]:
        """Each chosen segment's recompute under ``plan`` (checked by ``nesting_problem``)."""
        outer = {c: next((a for a in self.ancestors[c][1:] if a in plan), None) for c in plan}
        inner: dict[int, list[int]] = defaultdict(list)
        for c, o in outer.items():
            if o is not None:
                inner[o].append(c)
        frames = {}
        for c in plan:
            seg = self.segments[c]
            stop, burst_pos, frame_end, saves = seg.stop, seg.burst_pos, seg.frame_end, len(seg.packs)
            nested = [self.segments[i] for i in inner[c]]
            if nested:
                stop, burst_pos, frame_end, saves = self._outer_frame(seg, nested)
            depth = sum(1 for a in self.ancestors[c][1:] if a in plan)
            top = next((a for a in reversed(self.ancestors[c]) if a in plan), c)
            frames[c] = Frame(
                call=c,
                first_op=seg.first_op,
                end_op=seg.end_op,
                stop=stop,
                burst_pos=burst_pos,
                frame_end=frame_end,
                saves=saves,
                outer=outer[c],
                order=(-self.segments[top].first_op, depth),
                recorded_again=sum(n.range.own_ops for n in nested if n.range),
            )
        return frames

    def _outer_frame(self, seg: SegmentInfo, nested: list[SegmentInfo]) -> tuple[int, int | None, int, int]:
        """stop, burst position, frame end and saves of ``seg`` holding ``nested`` segments:
        its own saves plus each nested call's arguments, which that call's recompute unpacks."""
        packs = self.profile.packs
        inside = {p for n in nested for p in n.packs}
        own = [p for p in seg.packs if p not in inside]
        stop = max([packs[p].pos for p in own] + [n.end_op if n.range else n.first_op for n in nested])
        unpacks = [packs[p].unpack for p in own if packs[p].unpack is not None]
        unpacks += [n.burst_pos for n in nested if n.burst_pos is not None]
        frame_end = max([self.release(p) for p in own] + [n.frame_end for n in nested])
        saves = len(own) + sum(len(self.calls[n.call].inputs) for n in nested)
        return stop, min(unpacks) if unpacks else None, frame_end, saves

    def recompute_ms(self, call_index: int, kept: frozenset[int] = frozenset(), frame: Frame | None = None) -> float:
        """Time of a segment's recompute (as ``frame`` when nested): the ops it re-runs, timed one
        by one, each scaled to the wall time of the module call whose code runs it
        (``stretch_scales``), and a kept op's share of that code, which runs while its kernel
        does not; plus ``python_op_ms`` per op, what the step measured beyond that."""
        seg = self.segments[call_index]
        stop, burst_pos = (frame.stop, frame.burst_pos) if frame else (seg.stop, seg.burst_pos)
        if burst_pos is None:
            return 0.0
        ops = self.profile.ops
        scale = self._op_scale(call_index)
        rerun = sum(scale(i) * ops[i].time_ms for i in range(seg.first_op, stop) if i not in kept)
        kept_code = sum(max(0.0, scale(i) - 1.0) * ops[i].time_ms for i in kept if seg.first_op <= i < stop)
        return rerun + kept_code + self.profile.overheads.python_op_ms * (stop - seg.first_op)

    def kept_saving_ms(self, call_index: int, op_index: int) -> float:
        """What keeping op ``op_index`` takes off segment ``call_index``'s ``recompute_ms``: its
        re-run at its code's scale, less the share of that code that still runs (a scale above
        1). Where the call's wall is below its ops' timed sum (scale under 1) the saving is the
        scaled time, not the op's own: priced at the op's time, CP-SAT saw keeps that saved more
        than their segment cost and called a plan optimal 1.2 ms above the best."""
        seg = self.segments[call_index]
        if seg.burst_pos is None or not seg.first_op <= op_index < seg.stop:
            return 0.0
        return min(self._op_scale(call_index)(op_index), 1.0) * self.profile.ops[op_index].time_ms

    def _op_scale(self, call_index: int) -> Callable[[int], float]:
        """Op index -> the code scale its recompute in segment ``call_index`` runs at: a whole
        call's own, a stretch's (chain, op range) per op of its parent."""
        if call_index not in self.members and call_index not in self.ranges:
            scale = self.code_scale[call_index]
            return lambda _op: scale
        parent = self.profile.calls[self.calls[call_index].parent]
        scales = self.stretch_scales(parent.index)
        return lambda op: scales[op - parent.first_op]

    @cached_property
    def code_scale(self) -> dict[int, float]:
        """Module call -> the wall time of its forward over its ops' timed sum (1.0 where the
        profile has no wall time, or the call runs no timed op)."""
        ops = self.profile.ops
        scales: dict[int, float] = defaultdict(lambda: 1.0)
        for call in self.profile.calls:
            timed = sum(op.time_ms for op in ops[call.first_op : call.end_op])
            if call.time_ms is not None and timed > 0:
                scales[call.index] = call.time_ms / timed
        return scales

    @cached_property
    def _calls_made(self) -> dict[int, list[ModuleCall]]:
        return calls_made(self.profile)

    def stretch_scales(self, parent: int) -> tuple[float, ...]:
        """Per op of module call ``parent``: the code scale of the call whose code runs it when a
        stretch of ``parent`` (a chain, an op range) is recomputed. The stretch runs ``parent``'s
        calls as calls, so an op inside one costs as that outermost call's code does, and an
        own op as ``parent``'s. On tiny_gpt the model's scale (0.86) priced a range over two
        blocks (scale 1.0 each) 1.4 ms under their walls."""
        if parent not in self._stretch_scales:
            call = self.profile.calls[parent]
            scales = [self.code_scale[parent]] * (call.end_op - call.first_op)
            for child in self._calls_made.get(parent, ()):
                scales[child.first_op - call.first_op : child.end_op - call.first_op] = [
                    self.code_scale[child.index]
                ] * (child.end_op - child.first_op)
            self._stretch_scales[parent] = tuple(scales)
        return self._stretch_scales[parent]

    def overhead_ms(self, call_index: int, kept: frozenset[int] = frozenset(), frame: Frame | None = None) -> float:
        """Checkpoint machinery time of a segment: the call, each tensor saved through its
        frame (as ``frame`` when nested), and per op: the selective policy's dispatch modes, in
        forward and recompute, when it keeps ops; for an op range, the tape's recording and
        replay of its own ops (its recorder is off while its calls run), and a nested range's
        recording again in an outer recompute (``range_record_op_ms``)."""
        seg = self.segments[call_index]
        costs = self.profile.overheads
        saves, recorded_again = (frame.saves, frame.recorded_again) if frame else (len(seg.packs), 0)
        recorded_ms = costs.range_op_ms if costs.range_record_op_ms is None else costs.range_record_op_ms
        fixed = costs.segment_ms + costs.saved_tensor_ms * saves + recorded_ms * recorded_again
        if seg.range:
            return fixed + costs.range_op_ms * seg.range.own_ops
        return fixed + (costs.policy_op_ms * 2 * (seg.end_op - seg.first_op) if kept else 0.0)

    def added_ms(self, call_index: int, kept: frozenset[int] = frozenset(), frame: Frame | None = None) -> float:
        """What checkpointing the segment adds to the step: re-run ops plus machinery."""
        return self.recompute_ms(call_index, kept, frame) + self.overhead_ms(call_index, kept, frame)

    def occurrence(self, call_index: int, op_index: int) -> int:
        """Index of the op among same-overload ops of the segment (the SAC policy key)."""
        seg = self.segments[call_index]
        name = self.profile.ops[op_index].op
        return sum(1 for i in range(seg.first_op, op_index) if self.profile.ops[i].op == name)

    def _outer_first(self, plan: dict[int, frozenset[int]]) -> list[int]:
        return sorted(plan, key=lambda call: len(self.ancestors[call]))

    def chosen_segment_of_pack(self, plan: dict[int, frozenset[int]]) -> dict[int, int]:
        """Pack index -> the innermost chosen segment it was made in (packs outside every
        segment are absent): the checkpoint frame whose hooks saw it."""
        return {p: call for call in self._outer_first(plan) for p in self.packs_by_call.get(call, ())}

    def chosen_segment_of_op(self, plan: dict[int, frozenset[int]]) -> dict[int, int]:
        """Forward op index -> the innermost chosen segment running it."""
        owner: dict[int, int] = {}
        for call in self._outer_first(plan):
            seg = self.segments[call]
            owner.update(dict.fromkeys(range(seg.first_op, seg.end_op), call))
        return owner

    def touched_storages(self, call_index: int) -> list[int]:
        """Storages whose memory events checkpointing this call can move: its ops' outputs, what
        autograd saves inside it, and its arguments (held by checkpoint); the rest keep their
        events whatever is chosen for this call."""
        seg = self.segments[call_index]
        touched = {sid for op in range(seg.first_op, seg.end_op) for sid in self.outputs_by_op.get(op, ())}
        touched.update(self.profile.packs[p].storage for p in seg.packs)
        touched.update(self.calls[call_index].inputs)
        return sorted(touched)


def _with_chains(profile: Profile) -> tuple[tuple[ModuleCall, ...], dict[int, tuple[int, ...]]]:
    """The profile's calls followed by a call record per sibling chain, and each chain's members."""
    chains = sibling_chains(profile)
    records: list[ModuleCall] = []
    members: dict[int, tuple[int, ...]] = {}
    for run in chains:
        index = len(profile.calls) + len(records)
        first, last = run[0], run[-1]
        records.append(
            ModuleCall(
                index=index,
                fqn=f"{first.fqn}..{last.fqn}",
                type=CHAIN,
                first_op=first.first_op,
                end_op=last.end_op,
                parent=first.parent,
                checkpointable=True,
                inputs=first.inputs,
            )
        )
        members[index] = tuple(call.index for call in run)
    return profile.calls + tuple(records), members


def _with_ranges(
    profile: Profile, calls: tuple[ModuleCall, ...], members: dict[int, tuple[int, ...]]
) -> tuple[tuple[ModuleCall, ...], dict[int, OpRange]]:
    """``calls`` followed by a call record per op range, and each record's range."""
    chains = [tuple(calls[m] for m in run) for run in members.values()]
    records: list[ModuleCall] = []
    ranges: dict[int, OpRange] = {}
    for r in op_ranges(profile, chains):
        index = len(calls) + len(records)
        records.append(
            ModuleCall(
                index=index,
                fqn=f"{profile.calls[r.parent].fqn or '<model>'}[{r.first_op}:{r.end_op}]",
                type=RANGE,
                first_op=r.first_op,
                end_op=r.end_op,
                parent=r.parent,
                checkpointable=True,
                inputs=r.inputs,
            )
        )
        ranges[index] = r
    return calls + tuple(records), ranges
