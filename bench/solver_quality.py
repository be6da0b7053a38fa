"""Solver quality on problems with known answers, on the CPU.

Two sections, both on generated models (``bench/synthetic_models.py``) profiled with
monet's real profiler:

- brute force: small chains and skip DAGs whose every schedule can be enumerated and
  simulated. For budgets between the lowest reachable peak and the baseline peak, the
  best recompute time among the plans that fit is the known answer; the Planner must
  return it (within 0.01 ms, the check of tests/test_solver.py) and prove it (OPTIMAL).
  The exact check is on the solver's own integer objective (whole microseconds per
  segment and kept op), where brute force and CP-SAT must agree to the microsecond.
- scale: chains of about 100, 200, 300 and 500 forward ops, budgets 80% and 60% of the
  way from the minimum peak to the baseline peak: time to the first incumbent, to a
  proven optimum or a gap of 1% or less, final status and gap, and whether the simulator
  says the plan fits.

Usage, from the repository root::

    python bench/solver_quality.py            # full run, writes bench/results/solver-quality.json
    python bench/solver_quality.py --quick    # smallest cases only (CI smoke test)

``markdown(results)`` renders a results dict (the JSON) as Markdown tables for docs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python bench/solver_quality.py` puts bench/ first, not the root
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from ortools.sat.python import cp_model  # noqa: E402

from monet_cli.core.profile import InputSpec, Profile  # noqa: E402
from monet_cli.core.segments import SegmentModel  # noqa: E402
from monet_cli.core.simulate import Plan, simulate  # noqa: E402
from monet_cli.core.solver import search  # noqa: E402
from monet_cli.core.solver.cpsat import add_hint, build_model, objective_us, step_costs  # noqa: E402
from monet_cli.core.solver.enumerate import all_plans  # noqa: E402
from monet_cli.core.solver.heuristics import best_heuristic  # noqa: E402
from monet_cli.core.solver.search import Planner  # noqa: E402
from monet_cli.profiler.run import profile_model  # noqa: E402
from monet_cli.workload.resolve import Overrides, resolve_model_spec  # noqa: E402

CPU = torch.device("cpu")
DEFAULT_OUT = ROOT / "bench" / "results" / "solver-quality.json"
# "smoke-" names are what bench/report.py skips when it collects workload results.
QUICK_OUT = ROOT / "bench" / "results" / "smoke-solver-quality.json"

# Activations must dominate the peak for checkpointing to matter: with batch 8 the
# parameters, gradients and momentum of these MLPs are the peak and no schedule lowers
# it. Batch 256 on 64 features (block widths 32..192) keeps every op well under a
# millisecond and a 500-op profile under a few seconds.
BATCH = 256
WIDTH = 64
TOL_MS = 0.01
PROFILE_STEPS = 3
GAP_TARGET = 0.01


@dataclass(frozen=True)
class Case:
    name: str
    factory: str
    """``chain`` or ``skip_dag`` in bench.synthetic_models."""
    kwargs: dict[str, Any] = field(default_factory=dict)


# Seeds picked so each case has many distinct simulated peaks (a real trade-off) and at
# most ~20k schedules; smallest first (--quick runs the first of each kind).
BRUTE_CASES = (
    Case("chain-3-s4", "chain", {"n_blocks": 3, "seed": 4}),
    Case("chain-3-s1", "chain", {"n_blocks": 3, "seed": 1}),
    Case("chain-4-s5", "chain", {"n_blocks": 4, "seed": 5}),
    Case("chain-4-s4", "chain", {"n_blocks": 4, "seed": 4}),
    Case("dag-3-s4-cat", "skip_dag", {"n_blocks": 3, "seed": 4}),
    Case("dag-3-s1-add", "skip_dag", {"n_blocks": 3, "seed": 1}),
    Case("dag-4-s7-cat-add", "skip_dag", {"n_blocks": 4, "seed": 7}),
)
N_BUDGETS = 5
SCALE_TARGETS = (100, 200, 300, 500)
SCALE_FRACTIONS = (0.8, 0.6)
SCALE_SEED = 0


# -- profiles -------------------------------------------------------------------------


def profile_case(factory: str, kwargs: dict[str, Any]) -> tuple[Profile, float]:
    spec = resolve_model_spec(
        f"bench.synthetic_models:{factory}",
        Overrides(batch_size=BATCH, inputs=(InputSpec(shape=(WIDTH,)),), model_kwargs={"width": WIDTH, **kwargs}),
    )
    start = time.perf_counter()
    threads = torch.get_num_threads()
    # One intra-op thread: on a small, possibly shared CPU a two-thread OpenMP op slows
    # 10-100x whenever the other core is busy, and the op times are the problem's data.
    # The median of PROFILE_STEPS timed steps drops single outliers.
    torch.set_num_threads(1)
    try:
        profile = profile_model(spec, CPU, steps=PROFILE_STEPS)
    finally:
        torch.set_num_threads(threads)
    return profile, time.perf_counter() - start


def load_average() -> float | None:
    """1-minute load average (other processes on the machine slow the solver down)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


def model_shape(factory: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Block kinds (and skip sources and joins) of the generated model, for the record."""
    from bench import synthetic_models

    module = getattr(synthetic_models, factory)(width=WIDTH, **kwargs)
    shape: dict[str, Any] = {"kinds": list(module.kinds)}
    if hasattr(module, "sources"):
        shape["skips"] = [
            {"block": i, "from_block": s - 1, "join": j}
            for i, (s, j) in enumerate(zip(module.sources, module.joins))
            if s is not None
        ]
    return shape


# -- brute force ----------------------------------------------------------------------


def brute_force_case(case: Case, *, time_limit_s: float, workers: int, log: Callable[[str], None]) -> dict[str, Any]:
    profile, profile_s = profile_case(case.factory, case.kwargs)
    model = SegmentModel(profile)
    start = time.perf_counter()
    plans = all_plans(model)
    costs = step_costs(model)
    scored = []
    for plan in plans:
        result = simulate(profile, plan, model=model)
        scored.append((result.peak_bytes, result.added_ms, objective_us(model, costs, plan)))
    enumerate_s = time.perf_counter() - start
    lowest = min(peak for peak, _, _ in scored)
    highest = profile.baseline.peak_bytes
    budgets = sorted({lowest + (highest - lowest) * k // N_BUDGETS for k in range(N_BUDGETS)})
    planner = Planner(model, variants=False)  # the enumeration covers segment plans only
    rows = []
    for budget in budgets:
        fitting = [(ms, us) for peak, ms, us in scored if peak <= budget]
        best_ms = min(ms for ms, _ in fitting)
        best_us = min(us for _, us in fitting)
        outcome = planner.solve(budget, time_limit_s=time_limit_s, workers=workers, seed=0)
        solver_ms = outcome.result.added_ms if outcome.result is not None else None
        solver_us = objective_us(model, costs, outcome.plan) if outcome.plan is not None else None
        fits = outcome.result is not None and outcome.result.peak_bytes <= budget
        match = solver_ms is not None and abs(solver_ms - best_ms) <= TOL_MS and outcome.status == "OPTIMAL" and fits
        rows.append(
            {
                "budget_bytes": budget,
                "budget_frac": round((budget - lowest) / (highest - lowest), 3) if highest > lowest else 0.0,
                "plans_fitting": len(fitting),
                "bruteforce_ms": round(best_ms, 4),
                "solver_ms": None if solver_ms is None else round(solver_ms, 4),
                "bruteforce_objective_us": best_us,
                "solver_objective_us": solver_us,
                "status": outcome.status,
                "method": outcome.method,
                "rounds": outcome.rounds,
                "solve_s": outcome.time_s,
                "fits": fits,
                "match": match,
                "exact_match": solver_us == best_us and outcome.status == "OPTIMAL" and fits,
            }
        )
        log(
            f"  {case.name} budget {budget} ({rows[-1]['budget_frac']:.0%}): brute {best_ms:.4f} ms, "
            f"solver {solver_ms} ms, {outcome.status}, {outcome.time_s:.2f}s, match={match}"
        )
    below = planner.solve(lowest - 1, time_limit_s=time_limit_s, workers=workers, seed=0)
    return {
        "case": case.name,
        "model": f"bench.synthetic_models:{case.factory}",
        "kwargs": {"width": WIDTH, **case.kwargs},
        "shape": model_shape(case.factory, case.kwargs),
        "ops": len(profile.ops),
        "segments": len(model.segments),
        "keep_candidates": sum(len(s.candidates) for s in model.segments.values()),
        "plans": len(plans),
        "distinct_peaks": len({peak for peak, _, _ in scored}),
        "min_peak_bytes": lowest,
        "baseline_peak_bytes": highest,
        "forward_ms": round(sum(op.time_ms for op in profile.ops), 3),
        "profile_s": round(profile_s, 2),
        "enumerate_s": round(enumerate_s, 2),
        "below_min_status": below.status,
        "budgets": rows,
    }


# -- scale ----------------------------------------------------------------------------


def blocks_for(target_ops: int) -> tuple[int, int]:
    """(n_blocks, expected forward ops) of the chain closest to ``target_ops`` forward ops.

    Counts Linear as two ops (t, addmm), every other layer as one, plus the head and the
    loss (log_softmax, nll_loss). Blocks are drawn in order from the seeded RNG, so the
    first n blocks of a long chain are the chain of n blocks.
    """
    from torch import nn

    from bench import synthetic_models

    def ops(module: nn.Module) -> int:
        return sum(2 if isinstance(m, nn.Linear) else 1 for m in module.modules() if not list(m.children()))

    chain = synthetic_models.chain(n_blocks=target_ops, width=WIDTH, seed=SCALE_SEED)
    counts, total = [], ops(chain.head) + 2
    for block in chain.blocks:
        total += ops(block)
        counts.append(total)
    n = min(range(len(counts)), key=lambda i: (abs(counts[i] - target_ops), i))
    return n + 1, counts[n]


@contextmanager
def incumbents(events: list[dict[str, Any]], start: float) -> Iterator[None]:
    """Record every CP-SAT incumbent of Planner.solve at full precision.

    The Planner's report strings round to 0.01 ms, too coarse for a 1% gap on
    sub-millisecond objectives, so this wraps the solve_model the Planner calls and
    chains its own on_incumbent callback. Restored on exit.
    """
    original = search.solve_model
    round_no = 0

    def wrapped(*args: Any, on_incumbent: Callable[[float, float, float], None] | None = None, **kwargs: Any):
        nonlocal round_no
        round_no += 1
        this_round = round_no

        def hook(objective: float, bound: float, seconds: float) -> None:
            events.append(
                {
                    "round": this_round,
                    "t_s": round(time.perf_counter() - start, 3),
                    "objective_ms": objective / 1000,
                    "bound_ms": bound / 1000,
                }
            )
            if on_incumbent is not None:
                on_incumbent(objective, bound, seconds)

        return original(*args, on_incumbent=hook, **kwargs)

    search.solve_model = wrapped
    try:
        yield
    finally:
        search.solve_model = original


def reference_optimum(planner: Planner, budget_bytes: int, hint: Plan, *, time_limit_s: float) -> dict[str, Any]:
    """The same CP model (the Planner's first round) solved with CP-SAT's full LP relaxation.

    ``linearization_level=2`` puts the keep => segment implications into the LP, which
    bounds the objective well; monet's default two-worker portfolio (default_lp + fj)
    does not, so its own bound stays far below zero on these chains. When the Planner
    needed no cut rounds this is the optimum of exactly the problem it solved; with cuts
    it is a lower bound (cuts only tighten rows).
    """
    cp, variables = build_model(planner.model, planner.all_rows(), budget_bytes=budget_bytes)
    add_hint(cp, planner.model, variables, hint)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = 1
    solver.parameters.linearization_level = 2
    solver.parameters.random_seed = 0
    start = time.perf_counter()
    status = solver.solve(cp)
    found = status in (cp_model.OPTIMAL, cp_model.FEASIBLE)
    return {
        "status": solver.status_name(status),
        "objective_ms": solver.objective_value / 1000 if found else None,
        "bound_ms": solver.best_objective_bound / 1000 if found else None,
        "time_s": round(time.perf_counter() - start, 3),
    }


def gap_of(objective: float, bound: float) -> float:
    return 0.0 if objective <= 0 else max(0.0, (objective - bound) / objective)


def scale_case(
    target_ops: int, *, time_limit_s: float, min_peak_limit_s: float, workers: int, log: Callable[[str], None]
) -> dict[str, Any]:
    n_blocks, expected_ops = blocks_for(target_ops)
    kwargs = {"n_blocks": n_blocks, "seed": SCALE_SEED}
    profile, profile_s = profile_case("chain", kwargs)
    if len(profile.ops) != expected_ops:
        log(f"  note: expected {expected_ops} forward ops, the profile has {len(profile.ops)}")
    model = SegmentModel(profile)
    start = time.perf_counter()
    planner = Planner(model)
    setup_s = time.perf_counter() - start
    start = time.perf_counter()
    minimum = planner.minimum_peak(time_limit_s=min_peak_limit_s, workers=workers, seed=0)
    min_peak_s = time.perf_counter() - start
    baseline = profile.baseline.peak_bytes
    # What CP-SAT's bound is with no reasoning at all: every keep saving taken, no segment paid.
    trivial_bound_ms = -sum(step_costs(model).keep_saving.values()) / 1000
    log(
        f"  chain n_blocks={n_blocks}: {len(profile.ops)} forward ops (target {target_ops}), "
        f"{len(model.segments)} segments, {len(planner.pool)} memory rows; min peak {minimum.peak_bytes} "
        f"of baseline {baseline} ({min_peak_s:.1f}s)"
    )
    rows = []
    for frac in SCALE_FRACTIONS:
        budget = int(minimum.peak_bytes + frac * (baseline - minimum.peak_bytes))
        _, heuristic, heuristic_fits = best_heuristic(planner.linear, budget)
        heuristic_ms = simulate(profile, heuristic, model=model).added_ms if heuristic_fits else None
        events: list[dict[str, Any]] = []
        messages: list[tuple[float, str]] = []
        load = load_average()
        cpu0 = cpu_seconds()
        t0 = time.perf_counter()
        with incumbents(events, t0):
            outcome = planner.solve(
                budget,
                time_limit_s=time_limit_s,
                workers=workers,
                seed=0,
                report=lambda m, messages=messages, t0=t0: messages.append((round(time.perf_counter() - t0, 3), m)),
            )
        cpu_s = cpu_seconds() - cpu0
        final_round = outcome.rounds
        first = events[0]["t_s"] if events else None
        first_final = next((e["t_s"] for e in events if e["round"] == final_round), None)
        to_gap = next(
            (
                e["t_s"]
                for e in events
                if e["round"] == final_round and gap_of(e["objective_ms"], e["bound_ms"]) <= GAP_TARGET
            ),
            None,
        )
        if outcome.status == "OPTIMAL":
            to_gap = outcome.time_s if to_gap is None else to_gap
        fits = outcome.result is not None and outcome.result.peak_bytes <= budget
        reference = reference_optimum(planner, budget, heuristic, time_limit_s=time_limit_s)
        ref_ms = reference["objective_ms"] if reference["status"] == "OPTIMAL" else None
        to_ref = None
        if ref_ms is not None:
            to_ref = next(
                (
                    e["t_s"]
                    for e in events
                    if e["round"] == final_round and e["objective_ms"] <= ref_ms * (1 + GAP_TARGET) + 1e-9
                ),
                None,
            )
        rows.append(
            {
                "budget_frac": frac,
                "budget_bytes": budget,
                "heuristic_fits": heuristic_fits,
                "heuristic_ms": None if heuristic_ms is None else round(heuristic_ms, 4),
                "first_incumbent_s": first,
                "first_incumbent_final_round_s": first_final,
                "incumbents": len(events),
                "to_gap_1pct_s": to_gap,
                "to_optimal_s": outcome.time_s if outcome.status == "OPTIMAL" else None,
                "solve_s": outcome.time_s,
                "status": outcome.status,
                "method": outcome.method,
                "rounds": outcome.rounds,
                "objective_ms": outcome.objective_ms,
                "bound_ms": outcome.bound_ms,
                "trivial_bound_ms": trivial_bound_ms,
                "reference": reference,
                "excess_over_reference": None
                if ref_ms is None or outcome.objective_ms is None
                else round(
                    (outcome.objective_ms - ref_ms) / ref_ms if ref_ms > 0 else float(outcome.objective_ms > 0), 4
                ),
                "to_within_1pct_of_reference_s": to_ref,
                "gap": None if outcome.gap is None else round(outcome.gap, 4),
                "recompute_ms": None if outcome.result is None else round(outcome.result.added_ms, 4),
                "peak_bytes": None if outcome.result is None else outcome.result.peak_bytes,
                "fits": fits,
                "segments_chosen": 0 if outcome.plan is None else len(outcome.plan),
                "kept_ops": 0 if outcome.plan is None else sum(len(k) for k in outcome.plan.values()),
                "cpu_s": round(cpu_s, 2),
                "load_avg_1m": load,
                "messages": [list(m) for m in messages if not m[1].startswith("incumbent")],
                "trajectory": [
                    [e["t_s"], round(e["objective_ms"], 4), round(e["bound_ms"], 4), e["round"]] for e in events
                ],
            }
        )
        log(
            f"    {frac:.0%} budget {budget}: {outcome.status} gap {rows[-1]['gap']} in {outcome.time_s:.1f}s, "
            f"first incumbent {first}s, gap<=1% {to_gap}s, recompute {rows[-1]['recompute_ms']} ms "
            f"(heuristic {rows[-1]['heuristic_ms']}), fits={fits}; reference {reference['status']} "
            f"{reference['objective_ms']} ms in {reference['time_s']}s, reached within 1% at {to_ref}s"
        )
    return {
        "target_ops": target_ops,
        "model": "bench.synthetic_models:chain",
        "kwargs": {"width": WIDTH, **kwargs},
        "ops": len(profile.ops),
        "segments": len(model.segments),
        "keep_candidates": sum(len(s.candidates) for s in model.segments.values()),
        "memory_rows": len(planner.pool),
        "forward_ms": round(sum(op.time_ms for op in profile.ops), 3),
        "baseline_peak_bytes": baseline,
        "min_peak_bytes": minimum.peak_bytes,
        "profile_s": round(profile_s, 2),
        "planner_setup_s": round(setup_s, 2),
        "min_peak_s": round(min_peak_s, 2),
        "budgets": rows,
    }


# -- driver ---------------------------------------------------------------------------


def run(*, quick: bool, time_limit_s: float, workers: int, log: Callable[[str], None] = print) -> dict[str, Any]:
    import ortools

    started = time.perf_counter()
    load_start = load_average()
    brute_cases = (
        [next(c for c in BRUTE_CASES if c.factory == f) for f in ("chain", "skip_dag")] if quick else list(BRUTE_CASES)
    )
    targets = SCALE_TARGETS[:1] if quick else SCALE_TARGETS
    log(f"brute force: {len(brute_cases)} cases")
    brute = [brute_force_case(c, time_limit_s=20, workers=workers, log=log) for c in brute_cases]
    log(f"scale: chains of ~{', '.join(map(str, targets))} forward ops, {workers} workers, {time_limit_s:g}s limit")
    scale = [
        scale_case(t, time_limit_s=time_limit_s, min_peak_limit_s=min(30.0, time_limit_s), workers=workers, log=log)
        for t in targets
    ]
    rows = [r for case in brute for r in case["budgets"]]
    return {
        "kind": "monet.bench.solver-quality",
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "quick": quick,
        "settings": {
            "batch_size": BATCH,
            "width": WIDTH,
            "workers": workers,
            "time_limit_s": time_limit_s,
            "brute_time_limit_s": 20,
            "profile_steps": PROFILE_STEPS,
            "profile_threads": 1,
            "tolerance_ms": TOL_MS,
            "gap_target": GAP_TARGET,
            "device": "cpu",
        },
        "env": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "ortools": ortools.__version__,
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
            "load_avg_1m_start": load_start,
            "load_avg_1m_end": load_average(),
        },
        "summary": {
            "bruteforce_cases": len(brute),
            "bruteforce_budgets": len(rows),
            "bruteforce_matched": sum(r["match"] for r in rows),
            "bruteforce_exact_matched": sum(r["exact_match"] for r in rows),
            "bruteforce_all_matched": all(r["match"] for r in rows),
            "bruteforce_below_min_infeasible": all(c["below_min_status"] == "INFEASIBLE" for c in brute),
            "scale_runs": sum(len(c["budgets"]) for c in scale),
            "scale_all_fit": all(r["fits"] for c in scale for r in c["budgets"]),
            "scale_optimal": sum(r["status"] == "OPTIMAL" for c in scale for r in c["budgets"]),
            "scale_reference_optimal": sum(r["reference"]["status"] == "OPTIMAL" for c in scale for r in c["budgets"]),
            "scale_at_reference": sum(
                r["excess_over_reference"] is not None and r["excess_over_reference"] <= GAP_TARGET
                for c in scale
                for r in c["budgets"]
            ),
            "total_s": round(time.perf_counter() - started, 1),
        },
        "bruteforce": brute,
        "scale": scale,
    }


def _fmt(value: Any, spec: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    return format(value, spec)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f}"


def _tables(results: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    brute_rows = []
    for case in results["bruteforce"]:
        for r in case["budgets"]:
            brute_rows.append(
                [
                    case["case"],
                    str(case["ops"]),
                    str(case["segments"]),
                    str(case["plans"]),
                    f"{_mib(r['budget_bytes'])} ({r['budget_frac']:.0%})",
                    _fmt(r["bruteforce_ms"], ".4f"),
                    _fmt(r["solver_ms"], ".4f"),
                    r["status"],
                    _fmt(r["solve_s"], ".2f"),
                    _fmt(r["match"]),
                    _fmt(r["exact_match"]),
                ]
            )
    scale_rows = []
    for case in results["scale"]:
        for r in case["budgets"]:
            scale_rows.append(
                [
                    str(case["ops"]),
                    str(case["segments"]),
                    f"{r['budget_frac']:.0%}",
                    _mib(r["budget_bytes"]),
                    _fmt(r["heuristic_ms"], ".3f"),
                    _fmt(r["first_incumbent_s"], ".2f"),
                    _fmt(r["to_gap_1pct_s"], ".2f"),
                    _fmt(r["to_optimal_s"], ".2f"),
                    r["status"],
                    _fmt(r["gap"], ".3f"),
                    _fmt(r["objective_ms"], ".3f"),
                    _fmt(r["reference"]["objective_ms"] if r["reference"]["status"] == "OPTIMAL" else None, ".3f"),
                    _fmt(r["reference"]["time_s"], ".2f"),
                    _fmt(r["to_within_1pct_of_reference_s"], ".2f"),
                    str(r["rounds"]),
                    _fmt(r["cpu_s"] / r["solve_s"] if r["solve_s"] >= 1 else None, ".2f"),
                    _fmt(r["fits"]),
                ]
            )
    return [
        (
            "Brute force (every schedule enumerated and simulated)",
            [
                "case",
                "ops",
                "segs",
                "plans",
                "budget MiB (of range)",
                "brute ms",
                "solver ms",
                "status",
                "solve s",
                "match",
                "exact us",
            ],
            brute_rows,
        ),
        (
            f"Scale (chains, {results['settings']['workers']} workers, {results['settings']['time_limit_s']:g}s limit)",
            [
                "ops",
                "segs",
                "budget",
                "MiB",
                "heuristic ms",
                "1st incumbent s",
                "gap<=1% s",
                "optimal s",
                "status",
                "gap",
                "objective ms",
                "ref opt ms",
                "ref s",
                "<=1% of ref s",
                "rounds",
                "cpu/wall",
                "fits",
            ],
            scale_rows,
        ),
    ]


def markdown(results: dict[str, Any]) -> str:
    """The results as Markdown tables (for docs)."""
    s = results["summary"]
    env = results["env"]
    lines = [
        f"Solver quality, {env['cpus']} CPUs, torch {env['torch']}, OR-Tools {env['ortools']}, "
        f"batch {results['settings']['batch_size']} x {results['settings']['width']} features. "
        f"Brute force: {s['bruteforce_matched']}/{s['bruteforce_budgets']} budgets matched within "
        f"{results['settings']['tolerance_ms']} ms ({s['bruteforce_exact_matched']} to the microsecond of the "
        f"solver objective); a budget one byte under the lowest peak was INFEASIBLE in every case: "
        f"{_fmt(s['bruteforce_below_min_infeasible'])}. Scale: {s['scale_optimal']}/{s['scale_runs']} proven optimal, "
        f"all plans fit: {_fmt(s['scale_all_fit'])}; final plan within 1% of the reference optimum in "
        f"{s['scale_at_reference']}/{s['scale_runs']}. Total {s['total_s']} s.",
        "",
    ]
    for title, header, rows in _tables(results):
        lines += [f"**{title}**", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        lines.append("")
    lines.append(
        '"gap<=1% s": seconds to the first incumbent within 1% of CP-SAT\'s bound (or to the proof); '
        '"-" means not reached within the limit. "cpu/wall": process CPU seconds per wall second '
        "during solves of 1 s or more (about the worker count on an idle machine; lower means other load). "
        '"ref opt ms": the optimum of the same CP model proven by one CP-SAT worker with '
        'linearization_level=2; "<=1% of ref s": when the Planner\'s incumbent came within 1% of it.'
    )
    return "\n".join(lines) + "\n"


def text_table(results: dict[str, Any]) -> str:
    out = []
    for title, header, rows in _tables(results):
        widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
        out.append(title)
        out.append("  ".join(h.ljust(w) for h, w in zip(header, widths)))
        out += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
        out.append("")
    s = results["summary"]
    out.append(f"scale: Planner at the reference optimum (within 1%) in {s['scale_at_reference']}/{s['scale_runs']}")
    out.append(
        f"brute force matched {s['bruteforce_matched']}/{s['bruteforce_budgets']} "
        f"(exact {s['bruteforce_exact_matched']}); scale optimal {s['scale_optimal']}/{s['scale_runs']}, "
        f"all fit: {s['scale_all_fit']}; total {s['total_s']} s"
    )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smallest case of each section only (CI smoke test)")
    parser.add_argument(
        "--time-limit", type=float, default=None, help="CP-SAT limit per scale solve (60 s; 10 s with --quick)"
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"JSON path (default {DEFAULT_OUT.relative_to(ROOT)}; --quick: {QUICK_OUT.relative_to(ROOT)})",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="print per-budget progress")
    args = parser.parse_args(argv)
    time_limit = args.time_limit if args.time_limit is not None else (10.0 if args.quick else 60.0)
    out = args.out or (QUICK_OUT if args.quick else DEFAULT_OUT)
    log: Callable[[str], None] = (lambda m: print(m, flush=True)) if args.verbose else (lambda m: None)
    results = run(quick=args.quick, time_limit_s=time_limit, workers=args.workers, log=log)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(text_table(results))
    print(f"wrote {out}")
    return 0 if results["summary"]["bruteforce_all_matched"] and results["summary"]["scale_all_fit"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
