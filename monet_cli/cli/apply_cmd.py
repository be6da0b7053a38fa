"""``monet apply``: run a schedule against the unmodified model and hold it to its promises."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from monet_cli.core.profile import Profile
from monet_cli.core.schedule import load_schedule
from monet_cli.core.units import format_bytes
from monet_cli.errors import OverBudgetError, UsageError


@dataclass(frozen=True, kw_only=True)
class ApplyArgs:
    schedule: Path | None
    steps: int
    check: bool
    device: str | None
    json_output: bool
    timeline: Path | None = None
    profile: Path | None = None


def report_json(report) -> dict[str, Any]:
    """Exactly the documented keys, stable for CI jobs."""
    return {
        "budget_bytes": report.budget_bytes,
        "predicted_peak_bytes": report.predicted_peak_bytes,
        "measured_peak_bytes": report.measured_peak_bytes,
        "baseline_peak_bytes": report.baseline_peak_bytes,
        "step_ms": report.step_ms,
        "baseline_step_ms": report.baseline_step_ms,
        "overhead": report.overhead,
        "overhead_range": list(report.overhead_range),
        "predicted_overhead": report.predicted_overhead,
        "predicted_overhead_here": None if report.predicted_here is None else report.predicted_here.overhead,
        "profiled_baseline_step_ms": report.profiled_baseline_step_ms,
        "grads_match": None if report.check is None else report.check.ok,
        "within_budget": report.within_budget,
        "check": None if report.check is None else check_json(report.check),
    }


def check_json(check) -> dict[str, Any]:
    """How gradients were compared: ``exact`` bits under deterministic algorithms, or within
    ``rtol``/``atol`` because of ``nondeterministic``."""
    return {
        "mode": check.mode,
        "rtol": check.rtol,
        "atol": check.atol,
        "nondeterministic": check.nondeterministic,
        "max_grad_diff": check.max_grad_diff,
        "max_relative_diff": check.max_relative_diff,
        "variants": list(check.variants),
        "params_match": check.params_match,
        "buffers_match": check.buffers_match,
    }


def report_table(report, schedule_path: str):
    from rich.table import Table

    table = Table(title=f"monet apply: {schedule_path}", title_justify="left")
    table.add_column("")
    table.add_column("bytes", justify="right")
    table.add_column("", justify="right")
    table.add_row("budget", str(report.budget_bytes), format_bytes(report.budget_bytes))
    table.add_row("predicted peak", str(report.predicted_peak_bytes), format_bytes(report.predicted_peak_bytes))
    verdict = "[green]within budget[/green]" if report.within_budget else "[red]OVER BUDGET[/red]"
    table.add_row(
        "measured peak", str(report.measured_peak_bytes), f"{format_bytes(report.measured_peak_bytes)} {verdict}"
    )
    table.add_row("baseline peak", str(report.baseline_peak_bytes), format_bytes(report.baseline_peak_bytes))
    table.add_row("prediction error", "", f"{100 * report.prediction_error:+.2f}% of measured")
    table.add_row("step time", "", _step_time(report))
    if report.check is not None:
        c = report.check
        status = (
            ("[green]equal[/green]" if c.mode == "exact" else "[green]close[/green]") if c.ok else "[red]DIFFER[/red]"
        )
        table.add_row(
            "gradients",
            "",
            f"{status} (max |diff| {c.max_grad_diff:.2e}; params {c.params_match}, BN buffers {c.buffers_match})",
        )
        table.add_row("compared", "", c.describe())
    return table


def _step_time(report) -> str:
    """Medians, the measured overhead with the range of its pairs (the noise it sits in), and
    the predicted one."""
    pairs = len(report.paired_overheads)
    low, high = report.overhead_range
    spread = f" over {pairs} pairs, {100 * low:+.1f}% to {100 * high:+.1f}%" if pairs > 1 else " in 1 pair"
    here = report.predicted_here
    at_this_speed = (
        ""
        if here is None
        else f"; {100 * here.overhead:+.1f}% priced again in this run (at a {here.baseline_step_ms:.1f} ms step)"
    )
    return (
        f"{report.step_ms:.1f} ms vs {report.baseline_step_ms:.1f} ms: {100 * report.overhead:+.1f}%{spread}; "
        f"predicted {100 * report.predicted_overhead:+.1f}% (priced at a {report.profiled_baseline_step_ms:.1f} ms "
        f"unmodified step){at_this_speed}"
    )


def run(args: ApplyArgs) -> None:
    from rich.console import Console

    from monet_cli.cli.inspect_cmd import check_schedule_matches, find_profile
    from monet_cli.cli.render import print_json, stderr
    from monet_cli.cli.solve_cmd import newest
    from monet_cli.profiler.window import WindowTimer
    from monet_cli.runtime.compare import run_apply
    from monet_cli.workload.step import resolve_device

    if args.steps < 1:
        raise UsageError(f"--steps must be at least 1, got {args.steps}")
    path = args.schedule or newest("schedules/*.yaml", "schedule")
    schedule = load_schedule(path)
    device = resolve_device(args.device or schedule.fingerprint.device_type)
    if args.timeline is not None and device.type != "cpu":
        raise UsageError("--timeline records the measured step with the CPU meter; use --device cpu")
    found = find_profile(schedule, args.profile)
    if found is not None and args.profile is not None:
        check_schedule_matches(schedule, found[0])  # now, not after the timed steps
    window = None if found is None else WindowTimer(found[0])
    with stderr.status("applying ...") as status:
        report = run_apply(
            schedule,
            device,
            steps=args.steps,
            check=args.check,
            timeline=args.timeline is not None,
            progress=lambda label: status.update(f"apply: {label}"),
            window=window,
        )
    if window is None:
        missing = "no prediction at this run's speed" + (", no predicted timeline" if args.timeline else "")
        stderr.print(f"note: the schedule's profile is not in configs/ (or --profile): {missing}")
    if args.timeline is not None:
        write_measured_timeline(args.timeline, schedule, report, found)
        stderr.print(f"[green]wrote[/green] {args.timeline}")
    if args.json_output:
        print_json(report_json(report))
    else:
        Console().print(report_table(report, str(path)))
    if not report.within_budget:
        raise OverBudgetError(
            f"measured peak {format_bytes(report.measured_peak_bytes)} is above the budget {format_bytes(report.budget_bytes)}"
        )
    if report.check is not None and not report.check.ok:
        raise OverBudgetError(
            f"gradients differ from the unmodified model (max |diff| {report.check.max_grad_diff:.3e}, compared "
            f"{report.check.describe()})"
        )


def write_measured_timeline(path: Path, schedule, report, found: tuple[Profile, Path] | None) -> None:
    """Measured baseline and schedule beside the predicted schedule (when its profile is found)."""
    from monet_cli.cli.timeline import Series, write_timeline
    from monet_cli.core.plan import plan_of, variants_of
    from monet_cli.core.segments import SegmentModel
    from monet_cli.core.solver.linear import live_series

    series = [
        Series(label="no checkpointing (measured)", values=report.baseline_timeline),
        Series(label=f"schedule {schedule.budget_spec} (measured)", values=report.timeline),
    ]
    if found is not None:
        model = SegmentModel(found[0])
        series.append(
            Series(
                label=f"schedule {schedule.budget_spec} (predicted)",
                values=live_series(model, plan_of(schedule, model), variants_of(schedule, found[0])),
            )
        )
    write_timeline(path, f"{schedule.model.name}: live memory over one step", series, schedule.budget_bytes)
