"""The CP-SAT model: build, solve and extract, each testable alone.

Variables: ``seg[c]`` checkpoints module call c; ``keep[c,i]`` keeps op i's output
inside segment c (selective checkpointing) so it is not recomputed; ``nest[o,n]`` runs
segment n nested directly inside segment o; ``top[c]``: c is chosen and nested in no other
chosen segment; ``triple[o,m,n]`` runs n in m in o;
``variant[v]`` runs operator variant v (an output-keeping BatchNorm and what follows it, a
max-pooling keeping offsets) or offload v (a call's saved tensors in host memory).
Constraints: a chosen segment inside another chosen one is nested in the nearest of them,
as a nest pair (an outer may hold several, three levels at most, none keeping anything), so
of the segments sharing an op at most one is ``top``; a keep needs its segment; a variant
is never chosen with a segment or another variant that moves the same tensors; at every
point of the step the linear memory model stays within the budget (points inside a
recompute burst only count when that segment, or nested pair, is chosen), in units of a
power of two bytes (``memory_unit``) rounded up.
Objective: minimise recompute time in microseconds (the predicted overhead), or, in
``min_peak`` mode, the peak itself.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ortools.sat.python import cp_model

from monet_cli.core.segments import SegmentModel
from monet_cli.core.simulate import Plan, Variants
from monet_cli.core.solver.linear import LinearMemory, Path, nest_paths

US_PER_MS = 1000


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryRow:
    """One memory constraint: sum(coef * var) <= budget - base, maybe enforced by a segment."""

    point: int
    base: int
    seg_coefs: dict[int, int]
    keep_coefs: dict[tuple[int, int], int]
    nest_coefs: dict[tuple[int, int], int]
    triple_coefs: dict[tuple[int, int, int], int] = field(default_factory=dict)
    variant_coefs: dict[int, int] = field(default_factory=dict)
    burst_of: int | Path | None
    slack: int = 0
    """Bytes the simulator found this point under-predicted by (a cut from the solve loop)."""
    cut_for: tuple[int, ...] = ()
    """The segments whose interaction the slack stands for: the cut holds only where all of
    them are chosen (a plan without one of them may not under-predict there at all)."""

    def holds_for(self, plan: Plan) -> bool:
        return all(c in plan for c in self.cut_for)


@dataclass
class Variables:
    seg: dict[int, cp_model.IntVar] = field(default_factory=dict)
    keep: dict[tuple[int, int], cp_model.IntVar] = field(default_factory=dict)
    policy: dict[int, cp_model.IntVar] = field(default_factory=dict)
    """policy[c]: segment c keeps something, so its selective policy runs (and costs time)."""
    nest: dict[tuple[int, int], cp_model.IntVar] = field(default_factory=dict)
    top: dict[int, cp_model.IntVar] = field(default_factory=dict)
    triple: dict[tuple[int, int, int], cp_model.IntVar] = field(default_factory=dict)
    variant: dict[int, cp_model.IntVar] = field(default_factory=dict)
    peak: cp_model.IntVar | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Costs:
    """Objective coefficients in whole microseconds."""

    seg: dict[int, int]
    """A segment with nothing kept: all its ops re-run, plus the checkpoint call itself."""
    keep_saving: dict[tuple[int, int], int]
    """Keeping op i saves its re-run."""
    policy: dict[int, int]
    """Keeping anything in a segment adds the selective policy's per-op dispatch cost."""
    nest: dict[tuple[int, int], int]
    """Nesting changes the outer segment's recompute (it stops at the inner call's start
    when nothing later is saved); the inner segment's own cost is in ``seg``."""
    variant: dict[int, int]
    """A variant's measured forward and backward time beyond the unmodified modules'."""
    first_frame: int
    """What the step pays once when any segment is chosen."""
    checks: int
    """The schedule's checks on every training forward, paid by every plan (a constant: it keeps
    the objective equal to the simulated added time)."""


def step_costs(model: SegmentModel) -> Costs:
    seg, keep_saving, policy, nest = {}, {}, {}, {}
    variant = {v: round(site.time_ms * US_PER_MS) for v, site in enumerate(model.profile.variants)}
    for c, info in model.segments.items():
        seg[c] = round(model.added_ms(c) * US_PER_MS)
        policy[c] = round((model.overhead_ms(c, frozenset(info.candidates[:1])) - model.overhead_ms(c)) * US_PER_MS)
        for i in info.candidates:
            keep_saving[(c, i)] = round(model.kept_saving_ms(c, i) * US_PER_MS)
    for (outer, inner), frames in model.pair_frames.items():
        frame = frames[outer]
        nest[(outer, inner)] = round(model.added_ms(outer, frame=frame) * US_PER_MS) - seg[outer]
    return Costs(
        seg=seg,
        keep_saving=keep_saving,
        policy=policy,
        nest=nest,
        variant=variant,
        first_frame=round(model.profile.overheads.first_frame_ms * US_PER_MS),
        checks=round(model.profile.overheads.checks_ms * US_PER_MS),
    )


def objective_us(model: SegmentModel, costs: Costs, plan: Plan, variants: Variants = frozenset()) -> int:
    """The objective of ``plan`` exactly as ``build_model`` writes it."""
    return (
        (costs.first_frame if plan else 0)
        + costs.checks
        + sum(costs.variant[v] for v in variants)
        + sum(
            costs.seg[c] + (costs.policy[c] if kept else 0) - sum(costs.keep_saving[(c, i)] for i in kept)
            for c, kept in plan.items()
        )
        + sum(costs.nest[path[-2:]] for path in nest_paths(model, plan))
    )


def row_at(linear: LinearMemory, j: int, slack: int = 0, plan: Plan | None = None) -> MemoryRow:
    """The memory constraint of point ``j``; with ``slack``, a cut for the segments of ``plan``
    that move memory at ``j``."""
    seg_coefs, keep_coefs, nest_coefs, triple_coefs, variant_coefs = linear.coefficients_at(j)
    cut_for = tuple(sorted(c for c in seg_coefs if c in plan)) if slack and plan else ()
    return MemoryRow(
        point=j,
        base=int(linear.base[j]),
        seg_coefs=seg_coefs,
        keep_coefs=keep_coefs,
        nest_coefs=nest_coefs,
        triple_coefs=triple_coefs,
        variant_coefs=variant_coefs,
        burst_of=linear.points[j].burst_of,
        slack=slack,
        cut_for=cut_for,
    )


def build_model(
    model: SegmentModel,
    rows: list[MemoryRow],
    *,
    budget_bytes: int | None,
    min_peak: bool = False,
    variants: tuple[int, ...] = (),
    unit: int | None = None,
) -> tuple[cp_model.CpModel, Variables]:
    """The CP model over the segments and the offered ``variants``; ``budget_bytes=None`` with
    ``min_peak`` minimises the peak instead. Memory rows are in ``unit`` bytes, by default
    ``memory_unit``'s."""
    cp = cp_model.CpModel()
    v = Variables()
    for c, seg in model.segments.items():
        v.seg[c] = cp.new_bool_var(f"seg[{c}:{seg.fqn}]")
        v.policy[c] = cp.new_bool_var(f"policy[{c}]")
        cp.add_implication(v.policy[c], v.seg[c])
        for i in seg.candidates:
            v.keep[(c, i)] = cp.new_bool_var(f"keep[{c},{i}]")
            cp.add_implication(v.keep[(c, i)], v.policy[c])
    _add_overlaps(cp, model, v)
    _add_variants(cp, model, v, variants)
    unit = unit or memory_unit(rows, budget_bytes)
    if min_peak:
        top = max(
            (
                _units(r.base + r.slack, unit)
                + sum(max(0, _units(x, unit)) for coefs in _coefficients(r) for x in coefs.values())
                for r in rows
            ),
            default=0,
        )
        v.peak = cp.new_int_var(0, max(top, 1), "peak")
    limit = v.peak if min_peak else budget_bytes // unit
    for row in rows:
        _add_memory_row(cp, v, row, limit, unit)
    if min_peak:
        # The peak alone: weighted with the time as a tie-break, the objective's coefficients
        # (bytes times microseconds) grew past what CP-SAT solves exactly, and it proved
        # "optimal" a 686 MiB mobilenet_v2 plan beside a feasible 262 MiB one. Callers that
        # want the fastest plan at the smallest peak solve for it with that budget.
        cp.minimize(v.peak)
        return cp, v
    costs = step_costs(model)
    cp.minimize(
        (_any_of(cp, v.seg.values(), "any segment") * costs.first_frame if costs.first_frame else 0)
        + costs.checks
        + sum(costs.seg[c] * v.seg[c] for c in v.seg)
        + sum(costs.policy[c] * v.policy[c] for c in v.policy)
        - sum(costs.keep_saving[k] * v.keep[k] for k in v.keep)
        + sum(costs.nest[pair] * v.nest[pair] for pair in v.nest)
        + sum(costs.variant[i] * v.variant[i] for i in v.variant)
    )
    return cp, v


def _any_of(cp: cp_model.CpModel, choices: Iterable[cp_model.IntVar], name: str) -> cp_model.IntVar:
    """True when one of ``choices`` is (minimising keeps it false otherwise), for a cost paid
    once: only profiles that price it get it (older ones, and those whose steps were too slow
    to pair, say 0)."""
    chosen = cp.new_bool_var(name)
    for choice in choices:
        cp.add_implication(choice, chosen)
    return chosen


def _add_variants(cp: cp_model.CpModel, model: SegmentModel, v: Variables, offered: tuple[int, ...]) -> None:
    """One choice per offered variant (an offload too), never with a segment or another variant
    that moves the same tensors."""
    for index in offered:
        v.variant[index] = cp.new_bool_var(f"variant[{index}:{model.profile.variants[index].module}]")
        for call in model.variant_conflicts[index]:
            cp.add_at_most_one([v.variant[index], v.seg[call]])
    for a, b in sorted(model.variant_clashes):
        if a in v.variant and b in v.variant:
            cp.add_at_most_one([v.variant[a], v.variant[b]])


def _add_overlaps(cp: cp_model.CpModel, model: SegmentModel, v: Variables) -> None:
    """Overlapping segments are chosen together only nested, each in the nearest chosen one
    as a nest pair (crossing ones never), at most ``NEST_LEVELS`` deep."""
    outers: dict[int, list[int]] = defaultdict(list)
    for outer, inner in model.nest_pairs:
        var = v.nest[outer, inner] = cp.new_bool_var(f"nest[{outer},{inner}]")
        outers[inner].append(outer)
        for c in (outer, inner):
            cp.add_implication(var, v.seg[c])
            cp.add_implication(var, ~v.policy[c])  # nested segments keep nothing
        for between in model.between(outer, inner):
            cp.add_implication(var, ~v.seg[between])  # nested in the nearest chosen segment
    for c in model.segments:
        v.top[c] = cp.new_bool_var(f"top[{c}]")
        cp.add(v.seg[c] == v.top[c] + sum(v.nest[o, c] for o in outers[c]))
        nearer: list[cp_model.IntVar] = []  # c's nest variables whose outer is at most as far as ``ancestor``
        for ancestor in (a for a in model.ancestors[c][1:] if a in v.seg):
            if ancestor in outers[c]:
                nearer.append(v.nest[ancestor, c])
            if (ancestor, c) not in model.nestable:
                cp.add_at_most_one([v.seg[c], v.seg[ancestor]])
                continue
            # Both chosen: c is nested in its nearest chosen segment, one of its nest pairs'
            # outer segments up to ``ancestor``.
            cp.add(v.seg[c] + v.seg[ancestor] <= 1 + sum(nearer))
    for a, b in model.crossing_pairs:
        cp.add_at_most_one([v.seg[a], v.seg[b]])
    # Implied by the rest, but without these cliques the relaxation takes fractions of a
    # segment and of those inside it side by side, as if both freed their memory: on
    # resnet50 at 50% its root bound was 70% of the optimum, and proving took 4 to 5 times
    # as long.
    for shared in model.sharing_sets:
        cp.add_at_most_one([v.top[c] for c in shared])
    for outer, middle, inner in model.nest_triples:
        var = v.triple[outer, middle, inner] = cp.new_bool_var(f"triple[{outer},{middle},{inner}]")
        cp.add_bool_and([v.nest[outer, middle], v.nest[middle, inner]]).only_enforce_if(var)
        cp.add_bool_or([~v.nest[outer, middle], ~v.nest[middle, inner], var])
    for (_, _, inner), var in v.triple.items():
        for deeper in model.nest_pairs_of(inner):
            cp.add_bool_or([~var, ~v.nest[deeper]])  # NEST_LEVELS (three) at most


MAX_ROW_UNITS = 1 << 24
"""The largest number a memory row may hold in the CP model. With rows in bytes (about 1e9 on
resnet50) CP-SAT proved "optimal" a plan 7% above one it accepted when the plan was fixed;
in units of 64 to 1,024 bytes the same rows solve to the right optimum."""


def memory_unit(rows: list[MemoryRow], budget_bytes: int | None) -> int:
    """Bytes per unit of the CP model's memory rows: the smallest power of two that keeps every
    row's numbers within ``MAX_ROW_UNITS``."""
    largest = max(
        [abs(budget_bytes or 0)]
        + [abs(r.base + r.slack) for r in rows]
        + [abs(x) for r in rows for coefs in _coefficients(r) for x in coefs.values()]
    )
    unit = 1
    while largest // unit > MAX_ROW_UNITS:
        unit *= 2
    return unit


def peak_lower_bound(rows: list[MemoryRow], bound_units: float) -> int:
    """Bytes below which no plan's peak lies, from CP-SAT's bound on a ``min_peak`` model of
    ``rows``: rounding up to whole units puts a row at most ``unit - 1`` bytes above its sum for
    its base and each term, so the bound in bytes comes down by that much."""
    unit = memory_unit(rows, None)
    terms = max((sum(map(len, _coefficients(r))) for r in rows), default=0)
    return max(0, math.ceil(bound_units) * unit - (terms + 1) * (unit - 1))


def _coefficients(row: MemoryRow) -> tuple[dict, ...]:
    """The row's coefficients by family, in the order of ``Variables``' seg, keep, nest, triple, variant."""
    return row.seg_coefs, row.keep_coefs, row.nest_coefs, row.triple_coefs, row.variant_coefs


def _units(nbytes: int, unit: int) -> int:
    """Bytes in units, rounded up: a row within the budget in units is within it in bytes."""
    return -(-nbytes // unit)


def _add_memory_row(
    cp: cp_model.CpModel, v: Variables, row: MemoryRow, limit: cp_model.IntVar | int, unit: int
) -> None:
    families = zip(_coefficients(row), (v.seg, v.keep, v.nest, v.triple, v.variant))
    expr = _units(row.base + row.slack, unit) + sum(
        _units(coef, unit) * variables[key] for coefs, variables in families for key, coef in coefs.items()
    )
    constraint = cp.add(expr <= limit)
    enforced_by = [v.seg[c] for c in row.cut_for]
    if isinstance(row.burst_of, tuple):
        enforced_by.append((v.nest if len(row.burst_of) == 2 else v.triple)[row.burst_of])
    elif row.burst_of is not None:
        enforced_by.append(v.seg[row.burst_of])
    if enforced_by:
        constraint.only_enforce_if(enforced_by)


def add_hint(
    cp: cp_model.CpModel, model: SegmentModel, v: Variables, plan: Plan, variants: Variants = frozenset()
) -> None:
    paths = set(nest_paths(model, plan))
    links = {path[-2:] for path in paths}
    for pair, var in v.nest.items():
        cp.add_hint(var, pair in links)
    for triple, var in v.triple.items():
        cp.add_hint(var, triple in paths)
    for index, var in v.variant.items():
        cp.add_hint(var, index in variants)
    nested = {path[-1] for path in paths}
    for c, var in v.seg.items():
        cp.add_hint(var, c in plan)
        cp.add_hint(v.top[c], c in plan and c not in nested)
        cp.add_hint(v.policy[c], bool(plan.get(c)))
    for (c, i), var in v.keep.items():
        cp.add_hint(var, c in plan and i in plan[c])


@dataclass(frozen=True, kw_only=True, slots=True)
class CpResult:
    status: str
    plan: Plan | None
    variants: Variants = frozenset()
    objective: float | None
    bound: float | None
    wall_s: float
    refused: tuple[Plan, Variants] | None = None
    """The incumbent ``accept`` refused, where the search stopped; ``plan`` is then the last
    accepted one (None when there was none)."""


Accept = Callable[[Plan, Variants], bool]


class _Incumbents(cp_model.CpSolverSolutionCallback):
    """Reports each incumbent and stops the search at the first one ``accept`` refuses."""

    def __init__(self, v: Variables, report: Callable[[float, float, float], None] | None, accept: Accept | None):
        super().__init__()
        self.v = v
        self.report = report
        self.accept = accept
        self.start = time.perf_counter()
        self.accepted: tuple[Plan, Variants, float] | None = None
        self.refused: tuple[Plan, Variants] | None = None

    def on_solution_callback(self) -> None:
        if self.report is not None:
            self.report(self.objective_value, self.best_objective_bound, time.perf_counter() - self.start)
        if self.accept is None:
            return
        plan, variants = extract(self, self.v), chosen_variants(self, self.v)
        if self.accept(plan, variants):
            self.accepted = (plan, variants, self.objective_value)
        else:
            self.refused = (plan, variants)
            self.stop_search()


def solve_model(
    cp: cp_model.CpModel,
    v: Variables,
    *,
    time_limit_s: float,
    workers: int,
    seed: int,
    relative_gap: float = 0.0,
    on_incumbent: Callable[[float, float, float], None] | None = None,
    accept: Accept | None = None,
) -> CpResult:
    """Solve ``cp``; with ``relative_gap`` > 0, stop once the answer is proven within that
    fraction of the optimum. CP-SAT reports such a stop as OPTIMAL; it is returned as FEASIBLE
    unless the bound proves the answer optimal. With ``accept``, every incumbent is checked
    and the search stops at the first refused one (``CpResult.refused``): checking a lazily
    built model's incumbents as they come spares proving an answer that fails the check."""
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.1, time_limit_s)
    solver.parameters.relative_gap_limit = relative_gap
    solver.parameters.num_workers = workers
    solver.parameters.random_seed = seed
    # CP-SAT would swallow Ctrl-C and return its incumbent; let Python see it instead, so an
    # interrupted solve exits 130 and writes nothing.
    solver.parameters.catch_sigint_signal = False
    # The default LP relaxation leaves the bound far from the optimum on long chains (500 ops:
    # FEASIBLE after 60 s with a large gap); the full linearization proves them in about a second.
    solver.parameters.linearization_level = 2
    if workers == 2:
        # Two workers run one full-problem subsolver beside the interleaved LNS ones (OR-Tools
        # 9.15's log: any further listed subsolver, core once, never ran). By default it is
        # default_lp, whose bound stalls (mobilenet_v2: 30% gap after 60 s); the full LP
        # proves the same problems in seconds.
        solver.parameters.subsolvers.append("max_lp")
    incumbents = _Incumbents(v, on_incumbent, accept)
    status = solver.solve(cp, incumbents)
    if incumbents.refused is not None:
        accepted = incumbents.accepted
        return CpResult(
            status="FEASIBLE" if accepted else "UNKNOWN",
            plan=accepted[0] if accepted else None,
            variants=accepted[1] if accepted else frozenset(),
            objective=accepted[2] if accepted else None,
            bound=None,
            wall_s=solver.wall_time,
            refused=incumbents.refused,
        )
    name = solver.status_name(status)
    # The objective is integral: an answer under one unit above the bound is proven optimal.
    if status == cp_model.OPTIMAL and solver.objective_value - solver.best_objective_bound >= 1:
        name = "FEASIBLE"
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return CpResult(status=name, plan=None, objective=None, bound=None, wall_s=solver.wall_time)
    return CpResult(
        status=name,
        plan=extract(solver, v),
        variants=chosen_variants(solver, v),
        objective=solver.objective_value,
        bound=solver.best_objective_bound,
        wall_s=solver.wall_time,
    )


def extract(solver: cp_model.CpSolver | cp_model.CpSolverSolutionCallback, v: Variables) -> Plan:
    """Read the chosen segments and kept ops back into a plan (from a finished solve or an
    incumbent)."""
    plan: Plan = {}
    for c, var in v.seg.items():
        if solver.boolean_value(var):
            plan[c] = frozenset(i for (cc, i), kv in v.keep.items() if cc == c and solver.boolean_value(kv))
    return plan


def chosen_variants(solver: cp_model.CpSolver | cp_model.CpSolverSolutionCallback, v: Variables) -> Variants:
    return frozenset(i for i, var in v.variant.items() if solver.boolean_value(var))
