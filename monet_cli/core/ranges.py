"""Op ranges: segments over a stretch of one module's forward, its own code included.

A module's forward is a sequence of calls to other modules with the module's own ops
(functional code: ``out += identity``, attention arithmetic, a concatenation) between them.
A range runs from the start of one of these calls (or of the forward) to the end of a later
one (or of the forward), so its checkpoint frame opens and closes in module hooks, above
autograd, where the profile can tell which saved tensors fall inside. Its recompute replays
what the forward ran: the calls as calls (their own segments and guards run again) and the
module's own code as its recorded torch calls. Own code the replay cannot repeat is in no
range: a custom autograd Function's ops, or random ops given a generator
(``OpRecord.unreplayable``).

A range either holds some of the module's own ops, or spans two or more calls of which one at
least makes calls of its own (a block of a stage). Spans of leaf calls alone are left to
sibling chains (``segments.sibling_chains``): in a ResNet's blocks they are four ranges in
five, and the solver slows with the candidates far more than the floor gains from them.

What a range reads from before it (external tensors) is saved when the range closes, as
checkpoint saves its arguments: held until its backward is done or, nested in an outer
segment (its module's call, or a range of an enclosing module), saved by the outer frame,
which drops it and makes it again in its recompute. That recompute therefore runs to the
range's end (the range runs inside it, as a checkpoint).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from monet_cli.core.profile import ModuleCall, Profile

MAX_RANGE_CALLS = 16
"""Modules whose forward makes more calls than this (a stack of layers) offer no ranges: the
ranges grow with the square of the calls."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OpRange:
    parent: int
    """The module call whose forward the range is a stretch of."""
    first_op: int
    end_op: int
    calls: tuple[int, ...]
    """The calls the parent makes inside the range, in order."""
    opens_at_call: bool
    """The frame opens where the first call starts (else where the parent's forward starts)."""
    closes_at_call: bool
    """The frame closes where the last call ends (else where the parent's forward returns)."""
    skip: int
    """Calls of the first call's module the parent makes before the range opens at it."""
    own_ops: int
    """The parent's own ops inside the range (the recompute replays them)."""
    inputs: tuple[int, ...]
    """Activation storages made before the range that it reads: held until its backward is done."""


def calls_made(profile: Profile) -> dict[int, list[ModuleCall]]:
    """Each call that makes calls -> the calls it makes, in forward order."""
    children: dict[int, list[ModuleCall]] = defaultdict(list)
    for call in profile.calls:
        if call.parent is not None:
            children[call.parent].append(call)
    return {parent: sorted(calls, key=lambda c: c.first_op) for parent, calls in children.items()}


def own_op_count(parent: ModuleCall, calls: list[ModuleCall]) -> int:
    """How many of ``parent``'s ops run outside the ``calls`` it makes."""
    inside = {op for c in calls for op in range(c.first_op, c.end_op)}
    return sum(op not in inside for op in range(parent.first_op, parent.end_op))


def op_ranges(profile: Profile, chains: list[tuple[ModuleCall, ...]]) -> list[OpRange]:
    """Every range the solver may choose, in forward order (none repeats a chain's span)."""
    children = calls_made(profile)
    called = defaultdict(int)
    for call in profile.calls:
        called[call.fqn] += 1
    taken = {(run[0].first_op, run[-1].end_op) for run in chains}
    held = _held_outputs(profile)
    ranges = []
    for parent, calls in sorted(children.items()):
        if called[profile.calls[parent].fqn] == 1 and len(calls) <= MAX_RANGE_CALLS:
            ranges += [
                r
                for r in _ranges_in(profile, profile.calls[parent], calls, held, set(children), called)
                if (r.first_op, r.end_op) not in taken
            ]
    return sorted(ranges, key=lambda r: (r.first_op, -r.end_op))


def _ranges_in(
    profile: Profile,
    parent: ModuleCall,
    calls: list[ModuleCall],
    held: dict[int, tuple[int, ...]],
    parents: set[int],
    called: dict[str, int],
) -> list[OpRange]:
    # A call made several times is no segment for that reason alone (the range replays it as a
    # call); any other reason means its re-run does not repeat it, or it writes its inputs.
    if any(call.reason and called[call.fqn] == 1 for call in calls):
        return []
    # (at a call?, position); where a call starts or ends with the forward, its hook is the same boundary.
    starts = [(True, c.first_op) for c in calls]
    if calls[0].first_op != parent.first_op:
        starts.insert(0, (False, parent.first_op))
    ends = [(True, c.end_op) for c in calls]
    if calls[-1].end_op != parent.end_op:
        ends.append((False, parent.end_op))
    inside_calls = {op for c in calls for op in range(c.first_op, c.end_op)}
    ranges = []
    for opens_at_call, first in starts:
        for closes_at_call, end in ends:
            if end <= first or (first, end) == (parent.first_op, parent.end_op):
                continue
            members = tuple(c for c in calls if first <= c.first_op and c.end_op <= end)
            if not all(c.registered for c in members):
                continue  # the executor finds a range's calls by path
            if any(c.hooks_reason for c in members):
                continue  # the recompute calls them, hooks and all
            own = [op for op in range(first, end) if op not in inside_calls]
            if not own and (len(members) < 2 or all(c.index not in parents for c in members)):
                continue
            if any(profile.ops[op].unreplayable for op in own):
                continue
            inputs = _external_inputs(profile, first, members, own, held)
            if inputs is not None and not _writes_before(profile, first, end):
                skip = sum(1 for c in calls if c.fqn == members[0].fqn and c.first_op < first) if opens_at_call else 0
                ranges.append(
                    OpRange(
                        parent=parent.index,
                        first_op=first,
                        end_op=end,
                        calls=tuple(c.index for c in members),
                        opens_at_call=opens_at_call,
                        closes_at_call=closes_at_call,
                        skip=skip,
                        own_ops=len(own),
                        inputs=inputs,
                    )
                )
    return ranges


SMALL_SIDE_OUTPUTS = 1 / 16
"""An op's other outputs count as small beside its largest one up to this fraction of it."""


def _held_outputs(profile: Profile) -> dict[int, tuple[int, ...]]:
    """Op -> the activation storages a range that reads the op's output holds. The profile
    does not say which of an op's outputs a reader takes: where the op made one large output
    and small side outputs (a BatchNorm's or a LayerNorm's statistics), all of them, which
    over-states what is held by the side outputs' bytes; where it made two large ones (a
    dropout's mask), none: no range reads such an op's output."""
    made: dict[int, list[int]] = defaultdict(list)
    for storage in profile.storages:
        if storage.kind == "activation" and storage.producer is not None:
            made[storage.producer].append(storage.id)
    held = {}
    for op, storages in made.items():
        sizes = sorted((profile.storages[s].bytes for s in storages), reverse=True)
        if sum(sizes[1:]) <= sizes[0] * SMALL_SIDE_OUTPUTS:
            held[op] = tuple(storages)
    return held


def _external_inputs(
    profile: Profile, first: int, members: tuple[ModuleCall, ...], own: list[int], held: dict[int, tuple[int, ...]]
) -> tuple[int, ...] | None:
    """Activation storages made before ``first`` that the range holds (``_held_outputs``),
    or None when an own op reads from an op whose outputs cannot be told apart, or one of them
    is written in place later (the replay would read the written value)."""
    storages = profile.storages
    reads = {
        s
        for call in members
        for s in call.inputs
        if storages[s].kind == "activation" and storages[s].producer is not None and storages[s].producer < first
    }
    for op in own:
        for producer in profile.ops[op].inputs:
            if producer < first:
                if producer not in held:
                    return None
                reads.update(held[producer])
    if any(storages[s].mutated for s in reads):
        return None
    return tuple(sorted(reads))


def _writes_before(profile: Profile, first: int, end: int) -> bool:
    """Whether an op of the range writes in place to a tensor made before it."""
    return any(op.inplace_of is not None and op.inplace_of < first for op in profile.ops[first:end])


def packs_inside(profile: Profile, r: OpRange, by_call: dict[int, list[int]], parent_packs: list[int]) -> list[int]:
    """The packs the range's frame sees: those made inside its calls (``by_call``: each call's
    packs, its sub-calls' included), and the parent's own saves (``parent_packs``) between its
    first and last op. A parent-level save at the range's first position is the op before's
    output unless the frame opened with the parent's forward; one at its end position is the
    next op's input unless the frame closes with the parent's forward."""
    parent = profile.calls[r.parent]
    inside = [p for call in r.calls for p in by_call.get(call, ())]
    for index in parent_packs:
        pos = profile.packs[index].pos
        if r.first_op < pos < r.end_op or pos == r.first_op == parent.first_op or pos == r.end_op == parent.end_op:
            inside.append(index)
    return sorted(inside)
