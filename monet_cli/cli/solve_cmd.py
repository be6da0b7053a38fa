"""``monet solve``: budget in, schedule file out."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from monet_cli.core.plan import build_schedule
from monet_cli.core.profile import Profile, load_profile
from monet_cli.core.schedule import Schedule, SolverInfo, file_sha256, save_schedule
from monet_cli.core.segments import SegmentModel
from monet_cli.core.solver.search import Planner, SolveOutcome
from monet_cli.core.units import describe_bytes, format_bytes, parse_budget
from monet_cli.core.yamlio import check_writable
from monet_cli.errors import InfeasibleError, NoSolutionError, UsageError


@dataclass(frozen=True, kw_only=True)
class SolveArgs:
    profile: Path | None
    budget: str
    output: Path | None
    time_limit: float
    workers: int | None
    seed: int
    json_output: bool


def newest(pattern: str, what: str) -> Path:
    """The most recently written file matching ``pattern`` (the default input)."""
    found = sorted(Path().glob(pattern), key=lambda p: p.stat().st_mtime)
    if not found:
        raise UsageError(f"no {what} found ({pattern}); pass one explicitly")
    return found[-1]


def default_workers() -> int:
    """One worker (deterministic) in CI, else up to 8 cores."""
    if os.environ.get("CI"):
        return 1
    return max(1, min(8, os.cpu_count() or 1))


def schedule_name(profile_path: Path, budget_spec: str) -> str:
    stem = profile_path.name.removesuffix(".yaml").removesuffix(".profile")
    spec = budget_spec.strip().replace("%", "pct")
    return f"{stem}-{re.sub(r'[^A-Za-z0-9.]+', '', spec)}.yaml"


def solve_profile(
    profile: Profile, profile_path: Path, budget_spec: str, *, time_limit: float, workers: int, seed: int,
    report=lambda message: None,
) -> tuple[Schedule, SolveOutcome]:
    budget = parse_budget(budget_spec, baseline_peak_bytes=profile.baseline.peak_bytes)
    model = SegmentModel(profile)
    planner = Planner(model)
    outcome = planner.solve(budget, time_limit_s=time_limit, workers=workers, seed=seed, report=report)
    if outcome.plan is None:
        _explain_failure(planner, outcome, budget, time_limit, workers, seed)
    import ortools

    schedule = build_schedule(
        profile, outcome.plan, budget_bytes=budget, budget_spec=budget_spec, model=model,
        profile_sha256=file_sha256(profile_path),
        solver=SolverInfo(
            method=outcome.method, status=outcome.status, objective=outcome.objective_ms, bound=outcome.bound_ms,
            gap=outcome.gap, time_s=outcome.time_s, workers=workers, seed=seed, time_limit_s=time_limit,
            ortools=ortools.__version__,
        ),
    )
    if schedule.predicted.peak_bytes > budget:  # the simulator is the judge; never write a plan over budget
        raise AssertionError("internal error: solver returned a plan the simulator puts over budget")
    return schedule, outcome


def _explain_failure(planner: Planner, outcome: SolveOutcome, budget: int, time_limit: float, workers: int, seed: int) -> None:
    if outcome.status == "UNKNOWN":
        raise NoSolutionError(
            f"no schedule within {format_bytes(budget)} found (time limit {time_limit:g} s, "
            f"{outcome.rounds} solver round(s)); raise --time-limit or the budget"
        )
    minimum = planner.minimum_peak(time_limit_s=min(10.0, time_limit), workers=workers, seed=seed)
    parts = ", ".join(f"{_KIND_NAMES.get(k, k)} {format_bytes(v)}" for k, v in list(minimum.breakdown.items())[:4])
    raise InfeasibleError(
        f"budget {describe_bytes(budget)} is below the smallest peak monet can reach, "
        f"{describe_bytes(minimum.peak_bytes)}; at that peak: {parts}"
    )


_KIND_NAMES = {
    "param": "parameters", "grad": "gradients", "optimizer": "optimizer state", "activation": "activations",
    "temp": "backward temporaries", "recomputed": "recomputed activations", "input": "inputs", "buffer": "buffers",
}


def summary(schedule: Schedule, path: Path) -> dict[str, Any]:
    return {
        "schedule": str(path),
        "budget_bytes": schedule.budget_bytes,
        "budget_spec": schedule.budget_spec,
        "predicted_peak_bytes": schedule.predicted.peak_bytes,
        "baseline_peak_bytes": schedule.predicted.baseline_peak_bytes,
        "predicted_step_ms": schedule.predicted.step_ms,
        "baseline_step_ms": schedule.predicted.baseline_step_ms,
        "overhead": schedule.predicted.overhead,
        "segments": len(schedule.segments),
        "kept_ops": sum(len(s.kept_ops()) for s in schedule.segments),
        "status": schedule.solver.status,
        "method": schedule.solver.method,
        "objective_ms": schedule.solver.objective,
        "bound_ms": schedule.solver.bound,
        "gap": schedule.solver.gap,
        "solve_time_s": schedule.solver.time_s,
    }


def run(args: SolveArgs) -> None:
    from rich.console import Console

    from monet_cli.cli.render import print_json, schedule_table, stderr

    if args.time_limit <= 0:
        raise UsageError(f"--time-limit must be positive, got {args.time_limit:g}")
    if args.workers is not None and args.workers < 1:
        raise UsageError(f"--workers must be at least 1, got {args.workers}")
    profile_path = args.profile or newest("configs/*.profile.yaml", "profile")
    profile = load_profile(profile_path)
    budget = parse_budget(args.budget, baseline_peak_bytes=profile.baseline.peak_bytes)
    stderr.print(f"budget: {args.budget} = {describe_bytes(budget)}; baseline peak {format_bytes(profile.baseline.peak_bytes)}")
    output = args.output or Path("schedules") / schedule_name(profile_path, args.budget)
    check_writable(output)
    workers = args.workers or default_workers()
    with stderr.status("solving ...") as status:
        schedule, _ = solve_profile(
            profile, profile_path, args.budget, time_limit=args.time_limit, workers=workers, seed=args.seed,
            report=lambda message: status.update(f"solving: {message}"),
        )
    save_schedule(schedule, output)
    if args.json_output:
        print_json(summary(schedule, output))
    else:
        Console().print(schedule_table(schedule, str(output)))
    stderr.print(f"[green]wrote[/green] {output}")
