"""What checkpointing one module call would change, derived from a profile.

A segment is a module call run under non-reentrant ``torch.utils.checkpoint``. In the
forward, autograd keeps nothing it saves inside the segment (unless a selective policy
keeps an op's output). In backward, the first node that needs one of its saved tensors
re-runs the segment from its first op up to the op that made the last saved tensor
(checkpoint stops early there): one recompute burst per segment.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from functools import cached_property

from monet_cli.core.profile import Profile

# Ops selective checkpointing never caches (torch.utils.checkpoint.SAC_IGNORED_OPS),
# written out here so the core stays free of torch.
SAC_IGNORED_OPS = frozenset({
    "aten.detach.default", "prim.device.default", "aten.size.default", "aten.stride.default",
    "aten.numel.default", "aten.dim.default", "aten.is_contiguous.default",
})


@dataclass(frozen=True, kw_only=True, slots=True)
class SegmentInfo:
    call: int
    fqn: str
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
    """Ops whose outputs a selective policy may keep (saved, never mutated, not in-place)."""


class SegmentModel:
    """Per-call segment facts for one profile, computed once."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self.end = profile.num_positions

    @cached_property
    def ancestors(self) -> list[tuple[int, ...]]:
        """For each call: itself and its enclosing calls, innermost first."""
        chains: list[tuple[int, ...]] = []
        for call in self.profile.calls:
            parent = call.parent
            chains.append((call.index,) + (chains[parent] if parent is not None else ()))
        return chains

    @cached_property
    def packs_by_call(self) -> dict[int, list[int]]:
        """Packs made inside each call, including its sub-calls."""
        by_call: dict[int, list[int]] = defaultdict(list)
        for index, pack in enumerate(self.profile.packs):
            if pack.call is not None:
                for call in self.ancestors[pack.call]:
                    by_call[call].append(index)
        return by_call

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

    def release(self, pack_index: int) -> int:
        release = self.profile.packs[pack_index].release
        return self.end if release is None else release

    @cached_property
    def segments(self) -> dict[int, SegmentInfo]:
        """Every checkpointable call that autograd saves something inside."""
        return {
            call.index: self._segment(call.index)
            for call in self.profile.calls
            if call.checkpointable and self.packs_by_call.get(call.index)
        }

    def _segment(self, call_index: int) -> SegmentInfo:
        call = self.profile.calls[call_index]
        packs = tuple(self.packs_by_call[call_index])
        unpacks = [self.profile.packs[i].unpack for i in packs if self.profile.packs[i].unpack is not None]
        return SegmentInfo(
            call=call_index,
            fqn=call.fqn,
            first_op=call.first_op,
            end_op=call.end_op,
            packs=packs,
            stop=max(self.profile.packs[i].pos for i in packs),
            burst_pos=min(unpacks) if unpacks else None,
            frame_end=max(self.release(i) for i in packs),
            candidates=self._keep_candidates(call.first_op, call.end_op, packs),
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

    def recompute_ms(self, call_index: int, kept: frozenset[int] = frozenset()) -> float:
        seg = self.segments[call_index]
        if seg.burst_pos is None:
            return 0.0
        ops = self.profile.ops
        return sum((ops[i].time_ms for i in range(seg.first_op, seg.stop) if i not in kept), 0.0)

    def overhead_ms(self, call_index: int, kept: frozenset[int] = frozenset()) -> float:
        """Checkpoint machinery time of a segment; the selective policy only runs when it keeps ops."""
        seg = self.segments[call_index]
        costs = self.profile.overheads
        policy = costs.policy_op_ms * 2 * (seg.end_op - seg.first_op) if kept else 0.0
        return costs.segment_ms + policy

    def added_ms(self, call_index: int, kept: frozenset[int] = frozenset()) -> float:
        """What checkpointing the segment adds to the step: re-run ops plus machinery."""
        return self.recompute_ms(call_index, kept) + self.overhead_ms(call_index, kept)

    def occurrence(self, call_index: int, op_index: int) -> int:
        """Index of the op among same-overload ops of the segment (the SAC policy key)."""
        seg = self.segments[call_index]
        name = self.profile.ops[op_index].op
        return sum(1 for i in range(seg.first_op, op_index) if self.profile.ops[i].op == name)

    def overlaps(self, a: int, b: int) -> bool:
        return a in self.ancestors[b] or b in self.ancestors[a]

    def chosen_segment_of_pack(self, plan: dict[int, frozenset[int]]) -> dict[int, int]:
        """Pack index -> the chosen segment it was made in (packs outside every segment are absent).

        Chosen segments never nest, so each pack has at most one."""
        return {p: call for call in plan for p in self.packs_by_call.get(call, ())}

    def chosen_segment_of_op(self, plan: dict[int, frozenset[int]]) -> dict[int, int]:
        """Forward op index -> the chosen segment running it."""
        owner: dict[int, int] = {}
        for call in plan:
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
        touched.update(self.profile.calls[call_index].inputs)
        return sorted(touched)
