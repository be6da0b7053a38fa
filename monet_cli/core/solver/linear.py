"""A linear memory model for the solver, measured off the simulator.

The simulator is exact but not linear in the decisions. For CP-SAT we write the live
bytes at each point of the step as

    live(q) = base(q) + sum_c x_c * seg_delta[c, q] + sum_(c,i) k_ci * keep_delta[(c, i), q]
                      + sum_(o,n) y_on * nest_delta[(o, n), q] + sum_(o,m,n) t_omn * triple_delta[(o, m, n), q]
                      + sum_v z_v * variant_delta[v, q]

where x_c chooses segment c (nothing kept), k_ci keeps op i inside c, y_on nests
segment n directly in segment o, t_omn nests n in m in o (three levels) and z_v runs
operator variant v (never with a segment that moves the same storages, so variant rows add
exactly). Each delta row is the simulator's own difference between a one-segment plan and
the empty plan (or a one-keep plan and the bare segment, a nested pair and its two segments
alone, a nested triple and its two pairs), computed from only the storages those can move,
so the model is exact for single segments, nested pairs and triples; for several segments
side by side (an outer holding several inner ones among them) interactions are not
captured, which is why every solution is checked by the simulator again and the loop adds
what it missed.

Points q are the event keys of the simulator: after op t's allocations in the main
timeline, and after each allocation inside each segment's recompute burst (a nested
segment's burst has points of its own, ordered after its outer segment's, per chain of
enclosing segments).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from monet_cli.core.segments import NEST_LEVELS, Frame, SegmentModel
from monet_cli.core.simulate import (
    Key,
    Plan,
    Variants,
    burst_key,
    keep_delta_events,
    memory_events,
    nest_delta_events,
    segment_delta_events,
    triple_delta_events,
    variant_delta_events,
)

Path = tuple[int, ...]
"""Chosen segments from the outermost down to one nested in them: (outer, inner) or (outer, middle, inner)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Point:
    key: Key
    burst_of: int | Path | None
    """The segment whose recompute burst this point is in; for a nested segment's, its path
    from the outermost segment (None: the main timeline)."""


@dataclass(frozen=True, slots=True)
class StepRow:
    """A delta row stored by its changes, so memory stays linear in the step's length:
    ``values[k]`` holds from point ``at[k]`` up to ``at[k + 1]``, and 0 before ``at[0]``."""

    at: np.ndarray
    values: np.ndarray

    @property
    def support(self) -> tuple[int, int]:
        """[first, end) of the points where the row may be non-zero (end -1: to the last point)."""
        if not len(self.at):
            return 0, 0
        return int(self.at[0]), int(self.at[-1]) if self.values[-1] == 0 else -1

    def add_to(self, out: np.ndarray) -> None:
        """``out += row`` for a dense ``out`` over every point."""
        steps = np.zeros(len(out) + 1, dtype=np.int64)
        steps[self.at] = np.diff(self.values, prepend=0)
        out += np.cumsum(steps[:-1])

    def dense(self, n: int) -> np.ndarray:
        out = np.zeros(n, dtype=np.int64)
        self.add_to(out)
        return out

    def value_at(self, j: int) -> int:
        k = int(np.searchsorted(self.at, j, side="right")) - 1
        return 0 if k < 0 else int(self.values[k])


class LinearMemory:
    """base, per-segment and per-keep delta rows over every point of the step."""

    def __init__(self, model: SegmentModel, *, variants: tuple[int, ...] = ()) -> None:
        self.model = model
        self.variants = variants
        """The operator variants offered to the solver (indices into the profile's)."""
        self.points = self._points()
        self._codes = np.array([self.encode(p.key) for p in self.points], dtype=np.int64)
        order = np.argsort(self._codes, kind="stable")
        self.points = [self.points[i] for i in order]
        self._codes = self._codes[order]
        self.index_of = {p.key: j for j, p in enumerate(self.points)}

    # -- keys -------------------------------------------------------------------------
    def _points(self) -> list[Point]:
        model = self.model
        points = [Point(key=(t, 2), burst_of=None) for t in range(-1, model.end)]
        # An outer segment's burst runs to its own stop alone, and nested to where its frame
        # saved the inner segment's arguments: past its own stop for an op range, which
        # saves what it read when it closes.
        stops = {call: seg.stop for call, seg in model.segments.items()}
        for (outer, _), frames in model.pair_frames.items():
            stops[outer] = max(stops[outer], frames[outer].stop)
        for call, seg in model.segments.items():
            if seg.burst_pos is not None:
                frame = model.frames({call: frozenset()})[call]
                points += [
                    Point(key=burst_key(model, frame, op, 1), burst_of=call) for op in range(seg.first_op, stops[call])
                ]
        # A nested segment's burst, likewise, runs past its own stop when it holds an op range.
        nested_stops = {pair: frames[pair[1]].stop for pair, frames in model.pair_frames.items()}
        for (outer, middle, _), frames in model.triple_frames.items():
            nested_stops[outer, middle] = max(nested_stops[outer, middle], frames[middle].stop)
        paths = [(pair, frames[pair[1]], nested_stops[pair]) for pair, frames in model.pair_frames.items()]
        paths += [(triple, frames[triple[2]], frames[triple[2]].stop) for triple, frames in model.triple_frames.items()]
        for path, frame, stop in paths:
            points += [Point(key=burst_key(model, frame, op, 1), burst_of=path) for op in range(frame.first_op, stop)]
        return points

    @cached_property
    def _scale(self) -> tuple[int, int]:
        f = len(self.model.profile.ops) + 2
        # Burst codes use (f + neg_first) in 0..f, depth in 0..NEST_LEVELS-1 and op in 0..f-1:
        # keep them below span - 1.
        return f, 4 + 2 * (NEST_LEVELS + 1) * (f + 1) * (f + 1)

    def encode(self, key: Key) -> int:
        """Order-preserving integer for an event key (so numpy can sort and search)."""
        f, span = self._scale
        base = (key[0] + 1) * span
        if key[1] == 0:
            return base
        if key[1] == 2:
            return base + span - 1
        _, _, neg_first, depth, op, sub = key
        return base + 1 + (((f + neg_first) * NEST_LEVELS + depth) * f + op) * 2 + sub

    # -- rows ---------------------------------------------------------------------------
    def live(self, plan: Plan, variants: Variants = frozenset()) -> np.ndarray:
        """Live bytes at every point under ``plan`` (exact simulator numbers)."""
        return self._at_points(memory_events(self.model, plan, variants))

    def _step_row(self, events: list[tuple[Key, int]]) -> StepRow:
        """The running sum of ``events`` read at every point, stored by its changes."""
        codes = np.fromiter((self.encode(k) for k, _ in events), dtype=np.int64, count=len(events))
        deltas = np.fromiter((d for _, d in events), dtype=np.int64, count=len(events))
        first = np.searchsorted(self._codes, codes, side="left")  # the first point that sees each event
        keep = first < len(self._codes)
        first, deltas = first[keep], deltas[keep]
        order = np.argsort(first, kind="stable")
        first, deltas = first[order], deltas[order]
        at, starts = np.unique(first, return_index=True)
        steps = np.add.reduceat(deltas, starts) if len(starts) else deltas
        changed = steps != 0
        return StepRow(at=at[changed], values=np.cumsum(steps)[changed])

    def _at_points(self, events: list[tuple[Key, int]]) -> np.ndarray:
        """The running sum of ``events`` read at every point."""
        codes = np.fromiter((self.encode(k) for k, _ in events), dtype=np.int64, count=len(events))
        deltas = np.fromiter((d for _, d in events), dtype=np.int64, count=len(events))
        order = np.argsort(codes, kind="stable")
        codes, running = codes[order], np.cumsum(deltas[order])
        where = np.searchsorted(codes, self._codes, side="right") - 1
        return np.where(where >= 0, running[np.maximum(where, 0)], 0)

    @cached_property
    def base(self) -> np.ndarray:
        return self.live({})

    @cached_property
    def seg_delta(self) -> dict[int, StepRow]:
        return {c: self._step_row(segment_delta_events(self.model, c, frozenset())) for c in self.model.segments}

    @cached_property
    def keep_delta(self) -> dict[tuple[int, int], StepRow]:
        return {
            (c, i): self._step_row(keep_delta_events(self.model, c, i))
            for c, seg in self.model.segments.items()
            for i in seg.candidates
        }

    @cached_property
    def nest_delta(self) -> dict[tuple[int, int], StepRow]:
        return {pair: self._step_row(nest_delta_events(self.model, *pair)) for pair in self.model.nest_pairs}

    @cached_property
    def triple_delta(self) -> dict[tuple[int, int, int], StepRow]:
        return {triple: self._step_row(triple_delta_events(self.model, *triple)) for triple in self.model.nest_triples}

    @cached_property
    def variant_delta(self) -> dict[int, StepRow]:
        return {v: self._step_row(variant_delta_events(self.model, v)) for v in self.variants}

    def predict(self, plan: Plan, variants: Variants = frozenset()) -> np.ndarray:
        """The linear model's live bytes under ``plan`` (bursts of unchosen segments masked)."""
        total = self.base.copy()
        for v in variants:
            self.variant_delta[v].add_to(total)
        for c, kept in plan.items():
            self.seg_delta[c].add_to(total)
            for i in kept:
                self.keep_delta[(c, i)].add_to(total)
        for path in nest_paths(self.model, plan):
            self.nest_delta[path[-2:]].add_to(total)
            if len(path) == 3:
                self.triple_delta[path].add_to(total)
        return np.where(self.active_mask(plan), total, 0)

    def coefficients_at(
        self, j: int
    ) -> tuple[
        dict[int, int],
        dict[tuple[int, int], int],
        dict[tuple[int, int], int],
        dict[tuple[int, int, int], int],
        dict[int, int],
    ]:
        """Every non-zero segment, keep, nesting (pairs, then triples) and variant coefficient at point ``j``."""
        return (
            _nonzero_at(self.seg_delta, self._seg_spans, j),
            _nonzero_at(self.keep_delta, self._keep_spans, j),
            _nonzero_at(self.nest_delta, self._nest_spans, j),
            _nonzero_at(self.triple_delta, self._triple_spans, j),
            _nonzero_at(self.variant_delta, self._variant_spans, j),
        )

    @cached_property
    def _triple_spans(self) -> tuple[list, np.ndarray, np.ndarray]:
        return _spans(self.triple_delta)

    @cached_property
    def _variant_spans(self) -> tuple[list, np.ndarray, np.ndarray]:
        return _spans(self.variant_delta)

    @cached_property
    def _nest_spans(self) -> tuple[list, np.ndarray, np.ndarray]:
        return _spans(self.nest_delta)

    @cached_property
    def _seg_spans(self) -> tuple[list, np.ndarray, np.ndarray]:
        return _spans(self.seg_delta)

    @cached_property
    def _keep_spans(self) -> tuple[list, np.ndarray, np.ndarray]:
        return _spans(self.keep_delta)

    def representative_points(self) -> np.ndarray:
        """One point per stretch where no coefficient changes and the burst is the same: the
        one with the highest base. Only it can bind within its stretch."""
        n = len(self.points)
        cuts = {0}
        rows = (
            *self.seg_delta.values(),
            *self.keep_delta.values(),
            *self.nest_delta.values(),
            *self.triple_delta.values(),
            *self.variant_delta.values(),
        )
        for row in rows:
            cuts.update(row.at.tolist())
        bursts: dict = {None: -1}
        owner = np.array([bursts.setdefault(p.burst_of, len(bursts)) for p in self.points], dtype=np.int64)
        cuts.update((np.flatnonzero(np.diff(owner)) + 1).tolist())
        starts = np.array(sorted(cuts), dtype=np.int64)
        stretch = np.searchsorted(starts, np.arange(n), side="right") - 1
        order = np.lexsort((-self.base, stretch))
        _, first = np.unique(stretch[order], return_index=True)
        return np.sort(order[first])

    def active_mask(self, plan: Plan) -> np.ndarray:
        """The points that exist in ``plan``'s step: a nested segment's burst runs at the points
        of its path of enclosing segments, not at those of the segment chosen alone, a burst
        stops where its frame does under ``plan`` (an outer one earlier than alone), and a kept
        op is not re-run (selective checkpointing hands back its cached output without
        dispatching it)."""
        frames = self.model.frames(plan)
        stops = {_path(frames, call): frame.stop for call, frame in frames.items()}
        return np.array(
            [
                p.burst_of is None
                or (
                    p.key[-2] < stops.get(p.burst_of, -1)
                    and (isinstance(p.burst_of, tuple) or p.key[-2] not in plan[p.burst_of])
                )
                for p in self.points
            ]
        )


def nest_paths(model: SegmentModel, plan: Plan) -> list[Path]:
    """Each segment ``plan`` nests, as its path from the outermost segment holding it."""
    frames = model.frames(plan)
    return [path for call in plan if isinstance(path := _path(frames, call), tuple)]


def _path(frames: dict[int, Frame], call: int) -> int | Path:
    """``call`` alone when no chosen segment holds it, else its path from the outermost one."""
    path = [call]
    while frames[path[0]].outer is not None:
        path.insert(0, frames[path[0]].outer)
    return tuple(path) if len(path) > 1 else call


def _spans(rows: dict) -> tuple[list, np.ndarray, np.ndarray]:
    """Row ids with the first and end point of their supports, as arrays."""
    ids = list(rows)
    spans = np.array([rows[k].support for k in ids], dtype=np.int64).reshape(-1, 2)
    return ids, spans[:, 0], spans[:, 1]


def _nonzero_at(rows: dict, spans: tuple[list, np.ndarray, np.ndarray], j: int) -> dict:
    ids, first, end = spans
    inside = np.flatnonzero((first <= j) & ((end == -1) | (j < end)))
    values = ((ids[k], rows[ids[k]].value_at(j)) for k in inside)
    return {key: value for key, value in values if value != 0}


def live_series(model: SegmentModel, plan: Plan, variants: Variants = frozenset()) -> tuple[int, ...]:
    """Predicted live bytes after every op of the step, recompute bursts included, in run order."""
    linear = LinearMemory(model)
    values = linear.live(plan, variants)[linear.active_mask(plan)]
    return tuple(int(v) for v in values[1:])  # drop the point before the first op
