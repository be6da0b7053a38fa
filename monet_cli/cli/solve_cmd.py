"""``monet solve``: budget in, schedule file out."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from monet_cli.core.plan import solve_schedule
from monet_cli.core.profile import Profile, load_profile
from monet_cli.core.schedule import Schedule, file_sha256, save_schedule
from monet_cli.core.segments import SegmentModel
from monet_cli.core.solver.search import Planner, SolveOutcome
from monet_cli.core.units import describe_bytes, format_bytes, parse_budget, parse_size
from monet_cli.core.yamlio import check_writable
from monet_cli.errors import InfeasibleError, NoSolutionError, UsageError


@dataclass(frozen=True, kw_only=True)
class SolveArgs:
    profile: Path | None
    budget: str
    output: Path | None
    time_limit: float
    gap: float
    workers: int | None
    seed: int
    json_output: bool
    variants: bool = True
    offloads: bool = True


def newest(pattern: str, what: str) -> Path:
    """The most recently written file matching ``pattern`` (the default input)."""
    found = sorted(Path().glob(pattern), key=lambda p: p.stat().st_mtime)
    if not found:
        raise UsageError(f"no {what} found ({pattern}); pass one explicitly")
    return found[-1]


def workers_or_default(workers: int | None) -> int:
    """``--workers``, checked; without it one worker (deterministic) in CI, else up to 8 cores."""
    if workers is not None:
        if workers < 1:
            raise UsageError(f"--workers must be at least 1, got {workers}")
        return workers
    if os.environ.get("CI"):
        return 1
    return max(1, min(8, os.cpu_count() or 1))


def schedule_name(profile_path: Path, budget_spec: str) -> str:
    stem = profile_path.name.removesuffix(".yaml").removesuffix(".profile")
    spec = budget_spec.strip().replace("%", "pct")
    return f"{stem}-{re.sub(r'[^A-Za-z0-9.]+', '', spec)}.yaml"


def solve_profile(
    profile: Profile,
    profile_path: Path,
    budget_spec: str,
    *,
    time_limit: float,
    gap: float,
    workers: int,
    seed: int,
    variants: bool = True,
    offloads: bool = True,
    report=lambda message: None,
) -> tuple[Schedule, SolveOutcome]:
    budget = parse_budget(budget_spec, baseline_peak_bytes=profile.baseline.peak_bytes)
    planner = Planner(SegmentModel(profile), variants=variants, offloads=offloads)
    schedule, outcome = solve_schedule(
        planner,
        budget,
        budget_spec,
        time_limit_s=time_limit,
        workers=workers,
        seed=seed,
        relative_gap=gap,
        profile_sha256=file_sha256(profile_path),
        report=report,
    )
    if schedule is None:
        _explain_failure(planner, outcome, budget, time_limit, workers, seed)
    return schedule, outcome


def _explain_failure(
    planner: Planner, outcome: SolveOutcome, budget: int, time_limit: float, workers: int, seed: int
) -> None:
    if outcome.status == "UNKNOWN":
        raise NoSolutionError(
            f"no schedule within {format_bytes(budget)} found (time limit {time_limit:g} s, "
            f"{outcome.rounds} solver round(s)); raise --time-limit or the budget"
        )
    minimum = planner.minimum_peak(time_limit_s=min(10.0, time_limit), workers=workers, seed=seed)
    parts = ", ".join(f"{_KIND_NAMES.get(k, k)} {format_bytes(v)}" for k, v in list(minimum.breakdown.items())[:4])
    raise InfeasibleError(
        f"budget {describe_bytes(budget)} is below the smallest peak monet can reach; the lowest found "
        f"is {describe_bytes(minimum.peak_bytes)}, at which: {parts}"
    )


_KIND_NAMES = {
    "param": "parameters",
    "grad": "gradients",
    "optimizer": "optimizer state",
    "activation": "activations",
    "temp": "backward temporaries",
    "recomputed": "recomputed activations",
    "input": "inputs",
    "output": "the last step's output, until the forward returns",
    "buffer": "buffers",
    "workspace": "op workspaces (CUDA)",
    "unsplit": "allocator blocks beyond their requests (CUDA)",
}


def _show(status, message: str) -> None:
    """Incumbents: a live status line on a terminal, plain lines in CI logs."""
    from monet_cli.cli.render import stderr

    if stderr.is_terminal:
        status.update(f"solving: {message}")
    else:
        stderr.print(f"solve: {message}", highlight=False)


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
        "chains": len(schedule.chains),
        "ranges": len(schedule.ranges),
        "kept_ops": len(schedule.keeps),
        "variants": len(schedule.variants),
        "offloads": len(schedule.offloads),
        "offloaded_bytes": sum(o.bytes for o in schedule.offloads),
        "tolerance": schedule.tolerance(),
        "status": schedule.solver.status,
        "method": schedule.solver.method,
        "objective_ms": schedule.solver.objective,
        "bound_ms": schedule.solver.bound,
        "gap": schedule.solver.gap,
        "gap_limit": schedule.solver.gap_limit,
        "solve_time_s": schedule.solver.time_s,
    }


def _inputs(args: SolveArgs) -> tuple[Path, Profile, int]:
    """Checked solver options, the profile (default: the newest) and the worker count."""
    if args.time_limit <= 0:
        raise UsageError(f"--time-limit must be positive, got {args.time_limit:g}")
    if not 0 <= args.gap < 1:
        raise UsageError(f"--gap must be at least 0 and below 1 (0.01 = 1%), got {args.gap:g}")
    workers = workers_or_default(args.workers)
    profile_path = args.profile or newest("configs/*.profile.yaml", "profile")
    return profile_path, load_profile(profile_path), workers


def run(args: SolveArgs) -> None:
    from rich.console import Console

    from monet_cli.cli.render import print_json, schedule_table, stderr

    profile_path, profile, workers = _inputs(args)
    budget = parse_budget(args.budget, baseline_peak_bytes=profile.baseline.peak_bytes)
    stderr.print(
        f"budget: {args.budget} = {describe_bytes(budget)}; baseline peak {format_bytes(profile.baseline.peak_bytes)}"
    )
    output = args.output or Path("schedules") / schedule_name(profile_path, args.budget)
    check_writable(output)
    with stderr.status("solving ...") as status:
        schedule, _ = solve_profile(
            profile,
            profile_path,
            args.budget,
            time_limit=args.time_limit,
            workers=workers,
            seed=args.seed,
            gap=args.gap,
            variants=args.variants,
            offloads=args.offloads,
            report=lambda message: _show(status, message),
        )
    save_schedule(schedule, output)
    if args.json_output:
        print_json(summary(schedule, output))
    else:
        Console().print(schedule_table(schedule, str(output)))
    stderr.print(f"[green]wrote[/green] {output}")


def sweep_budgets(text: str, baseline_peak_bytes: int) -> list[str]:
    """``90%:40%:10%`` -> ['90%', '80%', ..., '40%']; ``16G:4G:2G`` -> byte counts, loosest first."""
    from fractions import Fraction

    parts = text.split(":")
    if len(parts) != 3:
        raise UsageError(f"--sweep '{text}': expected START:STOP:STEP, e.g. 90%:40%:10%")
    if all(p.strip().endswith("%") for p in parts):
        try:
            start, stop, step = (Fraction(p.strip()[:-1]) for p in parts)
        except (ValueError, ZeroDivisionError):
            raise UsageError(f"--sweep '{text}': percentages must be numbers") from None
        values, unit = [start, stop, step], "%"
    elif not any(p.strip().endswith("%") for p in parts):
        values, unit = [Fraction(parse_size(p)) for p in parts], ""
    else:
        raise UsageError(f"--sweep '{text}': use percentages for all three parts or sizes for all three")
    start, stop, step = values
    if step <= 0 or start < stop:
        raise UsageError(f"--sweep '{text}': go from the loosest budget down to the tightest with a positive step")
    budgets, current = [], start
    while current >= stop and len(budgets) < 100:
        budgets.append(f"{float(current):g}%" if unit else str(int(current)))
        current -= step
    for b in budgets:
        parse_budget(b, baseline_peak_bytes=baseline_peak_bytes)  # reject zero / nonsense up front
    return budgets


def run_sweep(args: SolveArgs, sweep: str, plot: Path | None) -> None:
    from rich.console import Console
    from rich.table import Table

    from monet_cli.cli.render import print_json, stderr

    profile_path, profile, workers = _inputs(args)
    budgets = sweep_budgets(sweep, profile.baseline.peak_bytes)
    planner = Planner(SegmentModel(profile), variants=args.variants, offloads=args.offloads)
    rows, hint = [], None
    with stderr.status("solving ...") as status:
        for spec in budgets:
            budget = parse_budget(spec, baseline_peak_bytes=profile.baseline.peak_bytes)
            status.update(f"solving {spec} ({format_bytes(budget)})")
            schedule, outcome = solve_schedule(
                planner,
                budget,
                spec,
                time_limit_s=args.time_limit,
                workers=workers,
                seed=args.seed,
                relative_gap=args.gap,
                hint=hint,
                profile_sha256=file_sha256(profile_path),
            )
            if schedule is None:
                rows.append({"budget_spec": spec, "budget_bytes": budget, "status": outcome.status, "schedule": None})
                break  # tighter budgets cannot do better
            hint = (outcome.plan, outcome.variants)
            path = Path("schedules") / schedule_name(profile_path, spec)
            save_schedule(schedule, path)
            rows.append({**summary(schedule, path), "budget_spec": spec})
    flag_non_monotonic(rows)
    if plot is not None:
        plot_sweep(rows, profile, plot)
    if args.json_output:
        print_json({"profile": str(profile_path), "points": rows})
        return
    table = Table(title=f"monet solve --sweep {sweep}: {profile.model.name}", title_justify="left")
    for column in ("budget", "predicted peak", "overhead", "status", "schedule"):
        table.add_column(column)
    for row in rows:
        peak = format_bytes(row["predicted_peak_bytes"]) if row.get("schedule") else "-"
        overhead = f"{100 * row['overhead']:+.1f}%" if row.get("schedule") else "-"
        if row.get("non_monotonic"):
            overhead += " (!)"
        table.add_row(
            f"{row['budget_spec']} = {format_bytes(row['budget_bytes'])}",
            peak,
            overhead,
            row["status"],
            row.get("schedule") or "infeasible",
        )
    Console().print(table)
    if any(row.get("non_monotonic") for row in rows):
        stderr.print(
            "(!) a tighter budget predicts less overhead than a looser one: the looser solve did not "
            "reach its optimum; raise --time-limit"
        )


def flag_non_monotonic(rows: list[dict[str, Any]]) -> None:
    """Mark points whose overhead is below a looser budget's (loosest first)."""
    solved = [r for r in rows if r.get("schedule")]
    for looser, tighter in zip(solved, solved[1:]):
        if tighter["overhead"] < looser["overhead"] - 1e-9:
            tighter["non_monotonic"] = True


def plot_sweep(rows: list[dict[str, Any]], profile: Profile, path: Path) -> None:
    from monet_cli.cli.timeline import plot_points

    solved = [r for r in rows if r.get("schedule")]
    plot_points(
        path,
        f"{profile.model.name}: predicted overhead vs peak memory",
        [(r["predicted_peak_bytes"], r["overhead"], r["budget_spec"]) for r in solved],
    )
