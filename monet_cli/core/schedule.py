"""The schedule: a flat list of decisions about a model's training step, scored by the
simulator.

Schema 2 lists one decision per line, each with its ``kind``:

- ``segment``: a module call whose forward runs under checkpoint (its saved tensors are
  recomputed in backward), with the time that costs; or a chain of sibling calls that
  runs under one checkpoint (named 'first..last', its module paths in ``chain``);
- ``keep``: inside a segment, an op whose output is kept from the forward instead. It names
  the op by its aten overload and its occurrence among ops of that overload inside the
  segment: the key selective activation checkpointing uses;
- ``variant``: an operator variant outside every segment (``monet_cli/core/variants.py``):
  its kind, the ops and modules it runs in, its measured time and the tolerance its
  gradients are held to (0 for a bit-exact one).

- ``offload``: a module call outside every segment whose saved tensors go to host memory
  while backward has not reached them (CUDA; ``monet_cli/core/offload.py``): which of the
  saves its forward makes are copied out (ordinals in the order it makes them), their
  bytes and the time the copies are predicted to add.
Schema 1 files (segments holding keep/recompute lists) are read and migrated.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Literal

from monet_cli.core.codec import flow_row, from_data, to_data
from monet_cli.core.profile import EnvInfo, Fingerprint, ModelSpec, VariantSite, check_header
from monet_cli.core.segments import NEST_LEVELS
from monet_cli.core.yamlio import atomic_write_text, dump_yaml, load_yaml_file
from monet_cli.errors import FileFormatError

SCHEDULE_KIND = "monet.schedule"
SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)
EXECUTOR = "segments+sac"


@flow_row
@dataclass(frozen=True, kw_only=True, slots=True)
class SegmentDecision:
    kind: Literal["segment"] = "segment"
    module: str
    """Module path whose forward runs under checkpoint; for a chain, 'first..last'."""
    call: int
    first_op: int
    end_op: int
    recompute_ms: float
    """Predicted time of the segment's recompute in backward: the ops it re-runs, priced at their
    share of the wall time of the code that runs them (``SegmentModel.recompute_ms``)."""
    overhead_ms: float = 0.0
    """Measured checkpoint machinery time (per call, plus per op when it keeps ops; the
    schedule's first segment also carries what the step pays once for checkpointing anything)."""
    chain: tuple[str, ...] = ()
    """A chain's module paths, in call order: sibling calls run under one checkpoint."""
    within: str | None = None
    """Set for an op range: the module whose forward it is a stretch of ('' is the model)."""
    calls: tuple[str, ...] = ()
    """An op range's calls (module paths, in order) that its module makes inside it."""
    opens_at_call: bool = False
    """An op range opens at the start of its first call (else at the start of the module's forward)."""
    closes_at_call: bool = False
    """An op range closes at the end of its last call (else at the end of the module's forward)."""
    skip: int = 0
    """How many times the module called the first call's module before the range opens."""
    own_ops: int = 0
    """The module's own ops inside an op range (checked at run time)."""

    @property
    def members(self) -> tuple[str, ...]:
        """The module paths the segment hooks."""
        if self.within is not None:
            return (self.within, *self.calls)
        return self.chain or (self.module,)


@flow_row
@dataclass(frozen=True, kw_only=True, slots=True)
class KeepDecision:
    kind: Literal["keep"] = "keep"
    segment: str
    """Module path of the segment the op runs in."""
    index: int
    """Position of the op in the profile's forward."""
    op: str
    occurrence: int
    """How many ops of the same overload ran before it inside the segment."""


@flow_row
@dataclass(frozen=True, kw_only=True, slots=True)
class VariantDecision(VariantSite):
    kind: Literal["variant"] = "variant"
    time_ms: float
    """Measured time the variant adds to the step (forward and backward)."""
    rtol: float
    atol: float
    """The tolerance its gradients are checked within (``atol`` times the largest gradient
    magnitude); both 0 for a bit-exact variant."""


@flow_row
@dataclass(frozen=True, kw_only=True, slots=True)
class OffloadDecision:
    kind: Literal["offload"] = "offload"
    module: str
    call: int
    first_op: int
    end_op: int
    packs: tuple[int, ...]
    """Ordinals, among the saves the call's forward makes, of those copied to host memory."""
    fetch_order: tuple[int, ...]
    """The moved storages, each named by the ordinal of its first save, in the order backward
    first needs them: the order they are fetched back, one ahead of need."""
    saves: int
    """How many saves the call's forward makes in all (checked when it runs)."""
    bytes: int
    """Device memory the copies free between the call's end and backward."""
    time_ms: float
    """Predicted from the profile's measured copy speed: copies out the call's forward does
    not hide, plus copies back."""


Decision = SegmentDecision | KeepDecision | VariantDecision | OffloadDecision


@dataclass(frozen=True, kw_only=True, slots=True)
class Predicted:
    peak_bytes: int
    step_ms: float
    overhead: float
    """Predicted step_ms / baseline step_ms - 1."""
    baseline_peak_bytes: int
    baseline_step_ms: float
    """The unscheduled step of the model as written (``Baseline.reference_step_ms``)."""
    peak_pos: int
    preparation_ms: float = 0.0
    """What every schedule's preparation of the model adds to the step (in-place activations
    run out of place), measured by the profile: step_ms is the baseline, this, ``checks_ms``
    and the decisions' time. Schedules made before it was measured say 0."""
    checks_ms: float = 0.0
    """What the schedule's checks on every training forward add to the step
    (``Overheads.checks_ms``), a schedule without decisions too: ``apply`` installs them on every
    schedule. Schedules made before they were priced apart say 0."""
    alloc_conf: str = ""
    """CUDA: the caching allocator's settings the peak was predicted for (the profile's,
    ``DeviceInfo.alloc_conf``); ``apply`` warns in a process with other settings."""


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
    gap_limit: float = 0.0
    """The relative gap at which the solver was told to stop (0: run to optimal or the time limit)."""
    ortools: str

    @classmethod
    def not_solved(cls, method: str, *, time_s: float = 0.0, workers: int = 1, time_limit_s: float = 0.0) -> SolverInfo:
        """What a schedule records of a plan chosen without a solve for its budget (a hand-made
        baseline, the plan of the smallest peak): no status, objective or bound."""
        return cls(
            method=method,
            status="n/a",
            objective=None,
            bound=None,
            gap=None,
            time_s=time_s,
            workers=workers,
            seed=0,
            time_limit_s=time_limit_s,
            ortools="",
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class _Header:
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
    """Hash of everything but ``created_at`` and ``solver.time_s``: equal for equal solves."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Schedule(_Header):
    decisions: tuple[Decision, ...] = ()
    """Each segment followed by the keeps inside it, in forward order; then the variants."""

    @property
    def segments(self) -> tuple[SegmentDecision, ...]:
        return tuple(d for d in self.decisions if isinstance(d, SegmentDecision))

    @property
    def chains(self) -> tuple[SegmentDecision, ...]:
        """The segments that span a chain of sibling calls."""
        return tuple(s for s in self.segments if s.chain)

    @property
    def ranges(self) -> tuple[SegmentDecision, ...]:
        """The segments that are op ranges."""
        return tuple(s for s in self.segments if s.within is not None)

    @property
    def keeps(self) -> tuple[KeepDecision, ...]:
        return tuple(d for d in self.decisions if isinstance(d, KeepDecision))

    def kept(self) -> dict[int, frozenset[int]]:
        """Segment call index -> kept op indices."""
        kept: dict[str, set[int]] = {s.module: set() for s in self.segments}
        for keep in self.keeps:
            kept[keep.segment].add(keep.index)
        return {s.call: frozenset(kept[s.module]) for s in self.segments}

    @property
    def variants(self) -> tuple[VariantDecision, ...]:
        return tuple(d for d in self.decisions if isinstance(d, VariantDecision))

    @property
    def offloads(self) -> tuple[OffloadDecision, ...]:
        return tuple(d for d in self.decisions if isinstance(d, OffloadDecision))

    def inexact_variants(self) -> tuple[VariantDecision, ...]:
        """The variants whose gradients are not bit-exact (they state a tolerance)."""
        return tuple(v for v in self.variants if v.rtol or v.atol)

    def tolerance(self) -> tuple[float, float] | None:
        """(rtol, atol) the gradients are held to: the loosest of its variants', None when exact."""
        inexact = self.inexact_variants()
        if not inexact:
            return None
        return max(v.rtol for v in inexact), max(v.atol for v in inexact)

    def kept_in(self, segment: str) -> tuple[KeepDecision, ...]:
        return tuple(k for k in self.keeps if k.segment == segment)

    def nested_in(self) -> dict[str, str]:
        """Module of each nested segment -> module of the nearest segment it runs in."""
        return {
            segment.module: enclosing[-1].module
            for segment, enclosing in _enclosing(self.segments)
            if enclosing and segment.end_op <= enclosing[-1].end_op
        }


OMITTED_WHEN_DEFAULT = frozenset(
    {
        "SegmentDecision.within",
        "SegmentDecision.calls",
        "SegmentDecision.opens_at_call",
        "SegmentDecision.closes_at_call",
        "SegmentDecision.skip",
        "SegmentDecision.own_ops",
        "Predicted.alloc_conf",
        "Fingerprint.hooks",
        "Fingerprint.output_bytes",
    }
)
"""An op range's fields (the lines of other segments leave them out of the file), the CUDA
allocator settings (CPU schedules and PyTorch's defaults leave them out) and the hooks and
output bytes of a profile made before they were recorded."""

# Optional keys added after the hash's payload was fixed: they enter it only when set, so
# schedules written before them keep their hash.
HASHED_WHEN_SET = (
    frozenset(
        {
            "InputSpec.name",
            "ModelSpec.precision",
            "Fingerprint.precision",
            "Fingerprint.modules",
            "SegmentDecision.chain",
            "Predicted.preparation_ms",
            "Predicted.checks_ms",
            "SolverInfo.gap_limit",
        }
    )
    | OMITTED_WHEN_DEFAULT
)


def content_hash(schedule: Schedule | _V1Schedule) -> str:
    """SHA-256 of the canonical payload: no timestamps, no wall times, no hash itself."""
    stripped = replace(schedule, created_at="", content_sha256="", solver=replace(schedule.solver, time_s=0.0))
    # Through the loader once, so a value typed 0 in memory and 0.0 in the file hash alike.
    data = to_data(from_data(type(schedule), to_data(stripped), source="<hash>"), omit_defaults=HASHED_WHEN_SET)
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), default=list)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def with_content_hash(schedule: Schedule) -> Schedule:
    return replace(schedule, content_sha256=content_hash(schedule))


HASH_MISMATCH = "content_sha256: does not match the file's contents (edited by hand? re-run monet solve)"


def consistency_problem(schedule: Schedule) -> str | None:
    """Why a schedule's parts disagree (e.g. decisions edited by hand), or None."""
    if schedule.content_sha256 != content_hash(schedule):
        return HASH_MISMATCH
    segments = {s.module: s for s in schedule.segments}
    if len(segments) != len(schedule.segments):
        return "decisions: a module is a segment twice"
    for s in schedule.segments:
        if s.first_op >= s.end_op:
            return f"decisions: segment '{s.module}' runs no ops ({s.first_op}..{s.end_op - 1})"
    for k in schedule.keeps:
        segment = segments.get(k.segment)
        if segment is None:
            return f"decisions: keep of op {k.index} names '{k.segment}', which is no segment"
        if not segment.first_op <= k.index < segment.end_op:
            return f"decisions: keep of op {k.index} is outside segment '{k.segment}' ({segment.first_op}..{segment.end_op - 1})"
    problem = _nesting_problem(schedule) or _variant_problem(schedule)
    if problem:
        return problem
    pred = schedule.predicted
    expected_ms = (
        pred.baseline_step_ms
        + pred.preparation_ms
        + pred.checks_ms
        + sum(s.recompute_ms + s.overhead_ms for s in schedule.segments)
    )
    changes = (*schedule.variants, *schedule.offloads)
    expected_ms += sum(v.time_ms for v in changes)
    if abs(expected_ms - pred.step_ms) > 1e-3 * (1 + len(schedule.segments) + len(changes)):
        return (
            f"predicted.step_ms: {pred.step_ms} does not match the baseline, the preparation, the checks, the "
            f"segments' recompute time and the variants' and offloads' time ({expected_ms:.4f})"
        )
    if pred.peak_bytes > schedule.budget_bytes:
        return f"predicted.peak_bytes: {pred.peak_bytes} is above budget_bytes {schedule.budget_bytes}"
    return None


def _nesting_problem(schedule: Schedule) -> str:
    """Segments may overlap only nested: each inside the ones enclosing it, at most
    ``NEST_LEVELS`` deep, none of them keeping anything."""
    keeping = {k.segment for k in schedule.keeps}
    for segment, enclosing in _enclosing(schedule.segments):
        if not enclosing:
            continue
        outer = enclosing[-1]
        names = f"'{outer.module}' and '{segment.module}'"
        if segment.end_op > outer.end_op:
            return f"decisions: segments {names} overlap"
        if keeping.intersection((outer.module, segment.module)):
            return f"decisions: segments {names} are nested and keep ops (nested segments recompute everything)"
        if len(enclosing) >= NEST_LEVELS:
            return f"decisions: segments {names} nest deeper than {NEST_LEVELS} levels"
    return ""


def _enclosing(segments: tuple[SegmentDecision, ...]) -> Iterator[tuple[SegmentDecision, tuple[SegmentDecision, ...]]]:
    """Each segment in op order, with the segments opened before it and not closed yet,
    outermost first (the last is the nearest one it runs in)."""
    open_segments: list[SegmentDecision] = []
    for segment in sorted(segments, key=lambda s: (s.first_op, -s.end_op)):
        while open_segments and open_segments[-1].end_op <= segment.first_op:
            open_segments.pop()
        yield segment, tuple(open_segments)
        open_segments.append(segment)


def _variant_problem(schedule: Schedule) -> str:
    """A variant or an offload runs outside every segment, and changes an op at most once."""
    seen: set[int] = set()
    changes = [(v.module, v.ops) for v in schedule.variants]
    changes += [(o.module, tuple(range(o.first_op, o.end_op))) for o in schedule.offloads]
    for module, ops in changes:
        if seen.intersection(ops):
            return f"decisions: the variant or offload at '{module}' changes an op another one changes"
        seen.update(ops)
        for s in schedule.segments:
            if any(s.first_op <= op < s.end_op for op in ops):
                return f"decisions: the variant or offload at '{module}' runs inside segment '{s.module}'"
    return ""


def save_schedule(schedule: Schedule, path: Path) -> None:
    atomic_write_text(Path(path), dump_yaml(to_data(schedule, omit_defaults=OMITTED_WHEN_DEFAULT)))


def schedule_from_data(data: dict[str, Any], *, source: str) -> Schedule:
    version = check_header(data, source=source, kind=SCHEDULE_KIND, versions=READABLE_VERSIONS)
    if version == 1:
        schedule = migrate_v1(data, source=source)
    else:
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


# -- schema 1: segments holding their op decisions ------------------------------------


@flow_row
@dataclass(frozen=True, kw_only=True, slots=True)
class _V1Op:
    index: int
    op: str
    occurrence: int
    action: Literal["keep", "recompute"]
    impl: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class _V1Segment:
    module: str
    call: int
    first_op: int
    end_op: int
    recompute_ms: float
    overhead_ms: float = 0.0
    decisions: tuple[_V1Op, ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class _V1Schedule(_Header):
    segments: tuple[_V1Segment, ...] = ()


def migrate_v1(data: dict[str, Any], *, source: str) -> Schedule:
    """A schema 1 schedule as schema 2: its hash checked the way it was written, then each
    segment followed by its keeps (its ``recompute`` entries were the default, now implied)."""
    old = from_data(_V1Schedule, data, source=source)
    if old.content_sha256 != content_hash(old):
        raise FileFormatError(f"{source}: {HASH_MISMATCH}")
    decisions: list[Decision] = []
    for s in old.segments:
        decisions.append(
            SegmentDecision(
                module=s.module,
                call=s.call,
                first_op=s.first_op,
                end_op=s.end_op,
                recompute_ms=s.recompute_ms,
                overhead_ms=s.overhead_ms,
            )
        )
        decisions += [
            KeepDecision(segment=s.module, index=d.index, op=d.op, occurrence=d.occurrence)
            for d in s.decisions
            if d.action == "keep"
        ]
    header = {f.name: getattr(old, f.name) for f in fields(_Header)}
    return with_content_hash(Schedule(**{**header, "schema_version": SCHEMA_VERSION}, decisions=tuple(decisions)))
