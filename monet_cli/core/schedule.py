"""The schedule: which module calls become checkpointed segments and, inside each, which
op outputs are kept from the forward (the rest are recomputed in backward).

Each decision names an op by its aten overload and its occurrence among ops of that
overload inside the segment: the key selective activation checkpointing uses. The
``action`` field is an open set of names so later versions can add ``offload`` or
``compress`` without a format break; ``impl`` names an operator variant.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from monet_cli.core.codec import flow_row, from_data, to_data
from monet_cli.core.profile import EnvInfo, Fingerprint, ModelSpec, check_header
from monet_cli.core.yamlio import atomic_write_text, dump_yaml, load_yaml_file
from monet_cli.errors import FileFormatError

SCHEDULE_KIND = "monet.schedule"
SCHEMA_VERSION = 1
KNOWN_ACTIONS = ("keep", "recompute")
EXECUTOR = "segments+sac"


@flow_row
@dataclass(frozen=True, kw_only=True, slots=True)
class OpDecision:
    index: int
    """Position of the op in the profile's forward."""
    op: str
    occurrence: int
    """How many ops of the same overload ran before it inside the segment."""
    action: str
    """``keep`` (saved from the forward) or ``recompute``."""
    impl: str | None = None
    """Operator variant; None = PyTorch's default."""

    def __post_init__(self) -> None:
        if self.action not in KNOWN_ACTIONS:
            raise ValueError(f"unknown action {self.action!r} for op {self.index} (known: {', '.join(KNOWN_ACTIONS)})")


@dataclass(frozen=True, kw_only=True, slots=True)
class SegmentDecision:
    module: str
    """Module path whose forward runs under checkpoint."""
    call: int
    first_op: int
    end_op: int
    recompute_ms: float
    """Profiled time of the ops this segment re-runs in backward."""
    overhead_ms: float = 0.0
    """Measured checkpoint machinery time (per call, plus per op when it keeps ops)."""
    decisions: tuple[OpDecision, ...] = ()
    """One entry per op whose output autograd saves; other ops are simply re-run."""

    def kept_ops(self) -> frozenset[int]:
        return frozenset(d.index for d in self.decisions if d.action == "keep")


@dataclass(frozen=True, kw_only=True, slots=True)
class Predicted:
    peak_bytes: int
    step_ms: float
    overhead: float
    """Predicted step_ms / baseline step_ms - 1."""
    baseline_peak_bytes: int
    baseline_step_ms: float
    peak_pos: int


@dataclass(frozen=True, kw_only=True, slots=True)
class SolverInfo:
    method: str
    status: str
    objective: float | None
    bound: float | None
    gap: float | None
    time_s: float
    workers: int
    seed: int
    time_limit_s: float
    ortools: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Schedule:
    schema_version: int
    kind: str
    budget_bytes: int
    budget_spec: str
    model: ModelSpec
    fingerprint: Fingerprint
    profile_sha256: str
    predicted: Predicted
    solver: SolverInfo
    env: EnvInfo
    executor: str = EXECUTOR
    created_at: str = ""
    content_sha256: str
    """Hash of everything above except ``created_at`` and ``solver.time_s``: equal for equal solves."""
    segments: tuple[SegmentDecision, ...] = field(default_factory=tuple)

    def kept(self) -> dict[int, frozenset[int]]:
        """Segment call index -> kept op indices."""
        return {s.call: s.kept_ops() for s in self.segments}

    def nested_in(self) -> dict[str, str]:
        """Module of each nested segment -> module of the segment it runs in."""
        return {inner.module: outer.module for inner in self.segments for outer in self.segments
                if outer is not inner and outer.first_op <= inner.first_op and inner.end_op <= outer.end_op}


# Optional keys added after the hash's payload was fixed: they enter it only when set, so
# schedules written before them keep their hash.
HASHED_WHEN_SET = frozenset({"InputSpec.name", "ModelSpec.precision", "Fingerprint.precision", "Fingerprint.modules"})


def content_hash(schedule: Schedule) -> str:
    """SHA-256 of the canonical payload: no timestamps, no wall times, no hash itself."""
    stripped = replace(schedule, created_at="", content_sha256="", solver=replace(schedule.solver, time_s=0.0))
    # Through the loader once, so a value typed 0 in memory and 0.0 in the file hash alike.
    data = to_data(from_data(Schedule, to_data(stripped), source="<hash>"), omit_defaults=HASHED_WHEN_SET)
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), default=list)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def with_content_hash(schedule: Schedule) -> Schedule:
    return replace(schedule, content_sha256=content_hash(schedule))


def consistency_problem(schedule: Schedule) -> str | None:
    """Why a schedule's parts disagree (e.g. decisions edited by hand), or None."""
    if schedule.content_sha256 != content_hash(schedule):
        return "content_sha256: does not match the file's contents (edited by hand? re-run monet solve)"
    problem = _nesting_problem(schedule.segments)
    if problem:
        return problem
    for s in schedule.segments:
        if s.first_op >= s.end_op or any(not s.first_op <= d.index < s.end_op for d in s.decisions):
            return f"segments.{s.module}: decisions outside the segment's ops {s.first_op}..{s.end_op - 1}"
    pred = schedule.predicted
    expected_ms = pred.baseline_step_ms + sum(s.recompute_ms + s.overhead_ms for s in schedule.segments)
    if abs(expected_ms - pred.step_ms) > 1e-3 * (1 + len(schedule.segments)):
        return f"predicted.step_ms: {pred.step_ms} does not match the segments' recompute time ({expected_ms:.4f})"
    if pred.peak_bytes > schedule.budget_bytes:
        return f"predicted.peak_bytes: {pred.peak_bytes} is above budget_bytes {schedule.budget_bytes}"
    return None


def _nesting_problem(segments: tuple[SegmentDecision, ...]) -> str:
    """Segments may overlap only as nested pairs: one inside another, two levels, one inner
    segment per outer one, neither keeping anything."""
    ordered = sorted(segments, key=lambda s: (s.first_op, -s.end_op))
    outer_of: dict[str, str] = {}
    for i, outer in enumerate(ordered):
        for inner in ordered[i + 1:]:
            if inner.first_op >= outer.end_op:
                break
            names = f"'{outer.module}' and '{inner.module}'"
            if inner.end_op > outer.end_op:
                return f"segments: {names} overlap"
            if outer.kept_ops() or inner.kept_ops():
                return f"segments: {names} are nested and keep ops (nested segments recompute everything)"
            if outer.module in outer_of or outer.module in outer_of.values():
                return f"segments: {names} nest more than one segment or deeper than two levels"
            outer_of[inner.module] = outer.module
    return ""


def schedule_to_data(schedule: Schedule) -> dict[str, Any]:
    return to_data(schedule)


def save_schedule(schedule: Schedule, path: Path) -> None:
    atomic_write_text(Path(path), dump_yaml(to_data(schedule)))


def schedule_from_data(data: dict[str, Any], *, source: str) -> Schedule:
    check_header(data, source=source, kind=SCHEDULE_KIND)
    schedule = from_data(Schedule, data, source=source)
    problem = consistency_problem(schedule)
    if problem is not None:
        raise FileFormatError(f"{source}: {problem}")
    return schedule


def load_schedule(path: Path) -> Schedule:
    path = Path(path)
    return schedule_from_data(load_yaml_file(path), source=str(path))


def file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
