"""The solve loop: heuristic warm start, CP-SAT, and the simulator as the final judge.

CP-SAT optimises the linear memory model, whose rows are added lazily: it starts from the
rows where the step's memory is highest, and each incumbent is simulated as CP-SAT finds
it. The search stops at the first one over budget: rows it violates join the model (the
most violated first), and where the simulator finds a point over budget that the linear
model missed (segments interacting), that point's row gets the missing bytes as a cut;
then CP-SAT runs again, warm-started from the last incumbent that fit. The optimum of a model
with fewer rows is a lower bound, so an answer that the simulator accepts is optimal
when CP-SAT proved it optimal for the rows it had. Where nothing is proven, the fastest start
that fit is returned less the segments and variants the budget does not need (``descent``).
A plan is only ever returned when the simulator says it fits.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from monet_cli.core.schedule import SolverInfo
from monet_cli.core.segments import SegmentModel
from monet_cli.core.simulate import Plan, SimResult, Variants, simulate
from monet_cli.core.solver.cpsat import (
    MemoryRow,
    add_hint,
    build_model,
    memory_unit,
    peak_lower_bound,
    row_at,
    solve_model,
)
from monet_cli.core.solver.descent import descend, fits_faster
from monet_cli.core.solver.heuristics import best_heuristic, lower_peak
from monet_cli.core.solver.linear import LinearMemory
from monet_cli.core.units import format_bytes

MAX_ROUNDS = 40
LAZY_ROWS = 64
"""Rows the model starts with, and at most this many more per round."""
LOWER_PEAK_S = 2.0
"""The most of a warm start's search that adding segments (``lower_peak``) may take: on
resnet50 (batch 32, 128 px) it fits or stops within 1 s, but on a 32-layer LLaMA-style decoder
(hidden 128) at 45% of its peak, below the smallest one, it ran 56 rounds over 13.6 s before it
stopped, where the solve had proved that budget infeasible in 4.7 s (12-07)."""
Report = Callable[[str], None]
Hint = tuple[Plan, Variants]
"""A plan and its operator variants that CP-SAT starts from."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SolveOutcome:
    plan: Plan | None
    """None when nothing fits the budget."""
    variants: Variants = frozenset()
    """Operator variants chosen with the plan."""
    result: SimResult | None
    status: str
    """OPTIMAL, FEASIBLE, INFEASIBLE or UNKNOWN (no schedule found in time)."""
    method: str
    objective_ms: float | None
    bound_ms: float | None
    gap: float | None
    time_s: float
    rounds: int


@dataclass(frozen=True, kw_only=True, slots=True)
class MinimumPeak:
    peak_bytes: int
    """The lowest simulated peak found."""
    lower_bound_bytes: int
    """No plan's peak is below this: CP-SAT's bound on the lazily built linear model, less what
    rounding its rows to whole units can add. Near ``peak_bytes`` once the search proved its
    answer; far below it where the time ran out first."""
    plan: Plan
    variants: Variants
    breakdown: dict[str, int]


def solver_info(
    outcome: SolveOutcome, *, workers: int, seed: int, time_limit_s: float, relative_gap: float = 0.0
) -> SolverInfo:
    """What a schedule file records about the solve that produced it."""
    import ortools

    return SolverInfo(
        method=outcome.method,
        status=outcome.status,
        objective=outcome.objective_ms,
        bound=outcome.bound_ms,
        gap=outcome.gap,
        time_s=outcome.time_s,
        workers=workers,
        seed=seed,
        time_limit_s=time_limit_s,
        gap_limit=relative_gap,
        ortools=ortools.__version__,
    )


def _quiet(message: str) -> None:
    pass


def _cp_sat(in_bytes: bool) -> str:
    """The method of an answer CP-SAT found, its memory rows in bytes or in rounded units."""
    return "cp-sat (rows in bytes)" if in_bytes else "cp-sat"


class Planner:
    """Everything derived from one profile, reused across budgets (sweeps)."""

    def __init__(self, model: SegmentModel, *, variants: bool = True, offloads: bool = True) -> None:
        self.model = model
        self.profile = model.profile
        self.offered = tuple(
            i for i, site in enumerate(model.profile.variants) if (offloads if site.impl == "offload" else variants)
        )
        """The operator variants and offloads the solver may choose (``variants=False``: no
        operator variant; ``offloads=False``: no offload)."""
        self.linear = LinearMemory(model, variants=self.offered)
        self.pool = self.linear.representative_points()
        """The points whose rows can bind; a row is built when it joins the CP model."""

    def solve(
        self,
        budget_bytes: int,
        *,
        time_limit_s: float,
        workers: int,
        seed: int,
        relative_gap: float = 0.0,
        report: Report = _quiet,
        hint: Hint | None = None,
    ) -> SolveOutcome:
        """The fastest plan within ``budget_bytes`` that the simulator accepts. With
        ``relative_gap`` > 0 CP-SAT stops once its answer is proven within that fraction of the
        fastest (status FEASIBLE, with the gap); 0 proves it optimal or runs to the time limit."""
        start = time.perf_counter()
        if self.profile.baseline.peak_bytes <= budget_bytes:
            result = self._simulate({}, frozenset())
            if result.peak_bytes <= budget_bytes:
                added_ms = result.added_ms  # the schedule's checks
                return self._outcome({}, result, "OPTIMAL", "no-checkpointing", added_ms, added_ms, start, 0)
        name, best, hint = self._warm_start(budget_bytes, hint, time_limit_s / 2, workers, seed, report)
        unproven = f"heuristic ({name})"  # how the plan in best was found, while nothing is proven
        rows = self._highest_rows()
        # The budget of the linear model, which adds up requests: lowered where the allocator's
        # unsplit blocks put an answer over the budget (CUDA), so nothing proven is then optimal.
        linear_budget = budget_bytes
        status, objective, bound, rounds = "UNKNOWN", None, None, 0
        in_bytes = False  # rows in whole bytes: no rounding, and no proof claimed
        for rounds in range(1, MAX_ROUNDS + 1):
            remaining = time_limit_s - (time.perf_counter() - start)
            if remaining <= 0.05:
                break
            rounded = 1 if in_bytes else memory_unit(rows, linear_budget)
            cp, variables = build_model(
                self.model, rows, budget_bytes=linear_budget, variants=self.offered, unit=rounded
            )
            add_hint(cp, self.model, variables, *hint)
            cp_result = solve_model(
                cp,
                variables,
                time_limit_s=remaining,
                workers=workers,
                seed=seed,
                relative_gap=relative_gap,
                on_incumbent=lambda obj, bnd, t, in_bytes=in_bytes: report(
                    f"incumbent {obj / 1000:.3f} ms added"
                    + ("" if in_bytes else f", bound {bnd / 1000:.3f} ms")  # in bytes no bound is claimed
                    + f", {t:.1f}s"
                ),
                accept=lambda plan, variants: self._peak(plan, variants) <= budget_bytes,
            )
            status = cp_result.status
            if cp_result.refused is None:
                if cp_result.plan is None:
                    if status == "INFEASIBLE" and best is not None and not in_bytes and rounded > 1:
                        # Rows in whole units, rounded up, count each plan a little high: within
                        # that of the smallest peak they can leave no plan where the simulator
                        # has one (mobilenet_v2: +42.1% for its smallest peak's plan descended,
                        # +26.3% in bytes). In bytes no proof is claimed: the units are there
                        # because CP-SAT's bounds went wrong with numbers that large.
                        report(f"round {rounds}: no plan in rounded units; rows in bytes from here")
                        in_bytes, hint = True, best[:2]
                        continue
                    break
                result = self._simulate(cp_result.plan, cp_result.variants)
                if result.peak_bytes <= budget_bytes:
                    objective, bound = cp_result.objective, cp_result.bound
                    if linear_budget < budget_bytes or in_bytes:
                        status, bound = "FEASIBLE", None
                    best = (cp_result.plan, cp_result.variants, result)
                    break
                over = (cp_result.plan, cp_result.variants)
            else:
                over = cp_result.refused
                if cp_result.plan is not None:  # the last incumbent that fit starts the next round
                    hint = (cp_result.plan, cp_result.variants)
                    unproven, best = self._better(budget_bytes, _cp_sat(in_bytes), hint, unproven, best)
            refused = self._simulate(*over)
            lowered = self._lowered_budget(budget_bytes, linear_budget, refused)
            added = self._violated_rows(rows, *over, lowered)
            report(
                f"round {rounds}: an answer's simulated peak {format_bytes(refused.peak_bytes)} is over budget; "
                f"{len(added)} more rows"
                + (f", requests planned within {format_bytes(lowered)}" if lowered < linear_budget else "")
            )
            status = "UNKNOWN"
            if not added and lowered == linear_budget:
                break
            rows, linear_budget = rows + added, lowered
        if best is None:
            # Infeasible within a lowered budget proves nothing about the budget itself.
            infeasible = status == "INFEASIBLE" and linear_budget == budget_bytes
            return self._outcome(
                None, None, "INFEASIBLE" if infeasible else "UNKNOWN", "cp-sat", None, None, start, rounds
            )
        if objective is None:  # nothing proven: the fastest plan that fit, less what it does not need
            plan, variants, result = descend(self.model, best, budget_bytes, deadline=start + time_limit_s)
            if result.step_ms < best[2].step_ms:
                report(f"descent: {result.added_ms:.3f} ms added, from {best[2].added_ms:.3f} ms")
                unproven += ", descent"
            return self._outcome(plan, result, "FEASIBLE", unproven, result.added_ms, None, start, rounds, variants)
        plan, variants, result = best
        bound_ms = None if bound is None else bound / 1000
        return self._outcome(
            plan, result, status, _cp_sat(in_bytes), objective / 1000, bound_ms, start, rounds, variants
        )

    def _warm_start(
        self, budget_bytes: int, hint: Hint | None, search_s: float, workers: int, seed: int, report: Report
    ) -> tuple[str, tuple[Plan, Variants, SimResult] | None, Hint]:
        """The fastest start that fits: the best heuristic's plan or the caller's ``hint``. When
        neither fits, segments added where the step's memory is highest until it fits
        (``lower_peak``), else the smallest peak's plan searched from there, both within
        ``search_s``: without a plan to start from, CP-SAT alone may find none in time, and a
        user would be told to raise the time limit for a budget that can be met (resnet50 at
        50% with a 2 s limit, 12-07). Returns its name, the start with its simulation (None
        when nothing fits) and the hint for CP-SAT."""
        searched_by = time.perf_counter() + search_s
        name, heuristic, fits = best_heuristic(self.linear, budget_bytes)
        report(f"warm start: {name} ({'fits' if fits else 'over budget'})")
        best = (heuristic, frozenset(), self._simulate(heuristic, frozenset())) if fits else None
        if hint is not None:
            name, best = self._better(budget_bytes, "given plan", hint, name, best)
        given_hint = hint if hint is not None else (heuristic, frozenset())
        if best is not None:
            return name, best, given_hint
        # From no segments: from the lowest level plan it stopped higher on every shipped
        # profile, or as high and slower (12-07).
        lowering_by = min(searched_by, time.perf_counter() + LOWER_PEAK_S)
        lowered, result = lower_peak(self.linear, {}, budget_bytes, deadline=lowering_by)
        fits = result.peak_bytes <= budget_bytes
        report(
            f"warm start: segments added where memory is highest, {format_bytes(result.peak_bytes)} "
            f"({'fits' if fits else 'over budget'})"
        )
        if fits:
            return "lower-peak", (lowered, frozenset(), result), (lowered, frozenset())
        lowest = self.minimum_peak(
            time_limit_s=max(searched_by - time.perf_counter(), 0.0),
            workers=workers,
            seed=seed,
            enough_bytes=budget_bytes,
            start=lowered,
        )
        fits = lowest.peak_bytes <= budget_bytes
        report(
            f"warm start: the smallest peak found, {format_bytes(lowest.peak_bytes)} "
            f"({'fits' if fits else 'over budget'})"
        )
        if not fits:
            return name, None, given_hint
        found = (lowest.plan, lowest.variants)
        return "smallest peak", (*found, self._simulate(*found)), found

    def _better(
        self, budget_bytes: int, name: str, hint: Hint, best_name: str, best: tuple[Plan, Variants, SimResult] | None
    ) -> tuple[str, tuple[Plan, Variants, SimResult] | None]:
        """``hint`` (as ``name``) when it fits and is faster than ``best``, else ``best``."""
        plan, variants = hint
        hinted = self._simulate(plan, variants)
        if fits_faster(hinted, budget_bytes, None if best is None else best[2]):
            return name, (plan, variants, hinted)
        return best_name, best

    @staticmethod
    def _lowered_budget(budget_bytes: int, linear_budget: int, refused: SimResult) -> int:
        """The linear model's budget after ``refused``: where its requests fit that budget and
        only the allocator's unsplit blocks put it over, lowered by what the blocks added (the
        refused answer then breaks it, and an answer with as much extra fits)."""
        if refused.requested_peak_bytes > linear_budget:
            return linear_budget
        return min(linear_budget, budget_bytes - (refused.peak_bytes - refused.requested_peak_bytes))

    def _highest_rows(self) -> list[MemoryRow]:
        """Where the lazy model starts: the rows at the highest memory of the unscheduled step."""
        top = self.pool[np.argsort(-self.linear.base[self.pool], kind="stable")[:LAZY_ROWS]]
        return [row_at(self.linear, int(j)) for j in top]

    def all_rows(self) -> list[MemoryRow]:
        """Every row the lazy model could add (the whole linear model, for reference solves)."""
        return [row_at(self.linear, int(j)) for j in self.pool]

    def _violated_rows(
        self, rows: list[MemoryRow], plan: Plan, variants: Variants, limit_bytes: int
    ) -> list[MemoryRow]:
        """Rows ``plan`` puts over ``limit_bytes``: missing rows of the linear model, most
        violated first, and cuts where the simulator counts more than the linear model (the
        missing bytes become the row's slack, for plans with the segments of ``plan`` that
        move memory there)."""
        exact = self.linear.live(plan, variants)
        predicted = self.linear.predict(plan, variants)
        active = self.linear.active_mask(plan)
        worst = np.maximum(exact, predicted)
        pool = self.pool[~np.isin(self.pool, [row.point for row in rows])]
        missing = pool[active[pool] & (worst[pool] > limit_bytes)]
        missing = missing[np.argsort(-worst[missing], kind="stable")][:LAZY_ROWS]
        under = np.flatnonzero(active & (exact > limit_bytes) & (exact > predicted))
        under = under[np.argsort(-exact[under], kind="stable")][:LAZY_ROWS]
        # A cut holds only for the segments that met there, so the point's own row joins too.
        plain = np.union1d(missing, np.setdiff1d(under, [row.point for row in rows]))
        return [row_at(self.linear, int(j)) for j in plain] + [
            row_at(self.linear, int(j), int(exact[j] - predicted[j]), plan) for j in under
        ]

    def _outcome(
        self, plan, result, status, method, objective, bound, start, rounds, variants=frozenset()
    ) -> SolveOutcome:
        gap = None
        if objective is not None and bound is not None:
            gap = 0.0 if objective <= 0 else max(0.0, (objective - bound) / objective)
        return SolveOutcome(
            plan=plan,
            variants=variants,
            result=result,
            status=status,
            method=method,
            objective_ms=objective,
            bound_ms=bound,
            gap=gap,
            time_s=round(time.perf_counter() - start, 3),
            rounds=rounds,
        )

    def minimum_peak(
        self, *, time_limit_s: float, workers: int, seed: int, enough_bytes: int = 0, start: Plan | None = None
    ) -> MinimumPeak:
        """The lowest simulated peak found: CP-SAT minimising the peak of the lazily grown
        linear model, each answer checked by simulation, and the heuristic's lowest plan (or
        ``start``, where lower: CP-SAT's hint), less the segments and variants that peak does
        not need (``descend``). Stops early at a plan whose peak is at most ``enough_bytes``,
        and then returns it as found."""
        began = time.perf_counter()
        _, heuristic, _ = best_heuristic(self.linear, 0)
        plans = ({}, heuristic) if start is None else ({}, heuristic, start)
        candidates = [(self._simulate(plan, frozenset()), plan, frozenset()) for plan in plans]
        hint = min(candidates[1:], key=lambda candidate: candidate[0].peak_bytes)[1]
        rows = self._highest_rows()
        lower_bound = 0
        for _ in range(MAX_ROUNDS):
            remaining = time_limit_s - (time.perf_counter() - began)
            if remaining <= 0.05 or min(result.peak_bytes for result, _, _ in candidates) <= enough_bytes:
                break
            cp, variables = build_model(self.model, rows, budget_bytes=None, min_peak=True, variants=self.offered)
            add_hint(cp, self.model, variables, hint)
            cp_result = solve_model(cp, variables, time_limit_s=remaining, workers=workers, seed=seed)
            if cp_result.bound is not None:  # the rows are a subset of the model's: their bound holds
                lower_bound = max(lower_bound, peak_lower_bound(rows, cp_result.bound))
            if cp_result.plan is None:
                break
            candidates.append((self._simulate(cp_result.plan, cp_result.variants), cp_result.plan, cp_result.variants))
            # The model's own peak for this answer: the highest of the rows it had.
            predicted = self.linear.predict(cp_result.plan, cp_result.variants)
            relaxed = max(
                int(predicted[row.point]) + (row.slack if row.holds_for(cp_result.plan) else 0) for row in rows
            )
            added = self._violated_rows(rows, cp_result.plan, cp_result.variants, relaxed)
            if not added:
                break
            rows = rows + added
        # The lowest peak, the earliest of equals.
        result, plan, variants = min(candidates, key=lambda candidate: candidate[0].peak_bytes)
        if not enough_bytes:  # a solve's warm start (``enough_bytes``) descends at its budget instead
            # Minimising the peak alone checkpoints whatever does not raise it: keep what it needs.
            plan, variants, result = descend(
                self.model, (plan, variants, result), result.peak_bytes, deadline=began + time_limit_s
            )
        peak = result.peak_bytes
        return MinimumPeak(
            peak_bytes=peak,
            lower_bound_bytes=min(lower_bound, peak),
            plan=plan,
            variants=variants,
            breakdown=self.breakdown(plan, variants),
        )

    def _peak(self, plan: Plan, variants: Variants) -> int:
        return self._simulate(plan, variants).peak_bytes

    def _simulate(self, plan: Plan, variants: Variants) -> SimResult:
        return simulate(self.profile, plan, model=self.model, variants=variants)

    def breakdown(self, plan: Plan, variants: Variants = frozenset()) -> dict[str, int]:
        """Bytes by kind (parameters, gradients, optimizer state, activations, ...) at the peak."""
        from monet_cli.core.simulate import peak_breakdown

        return peak_breakdown(self.model, plan, variants)
