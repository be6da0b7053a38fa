"""Operator variants against checkpointing alone: two trade-off curves per workload, measured
in one process.

For each workload: one profile; budgets from 90% of the baseline peak down in 10% steps to
the smallest peak each solver reaches, and the peak of 3x less activation memory (the
issue's target, where a solver reaches it), solved twice (with operator variants, and with
``variants=False``); every schedule applied and timed interleaved with the unmodified step
(each repeat runs every method once, in rotating order; a point's overhead is the median of its
step over the unmodified step's in the same repeat), its peak measured, and for every
schedule with variants the gradient check (within the stated tolerance; BatchNorm
statistics bit for bit). Writes bench/results/variants-<workload>-<device>.json;
``bench/report.py`` puts the tables and plots in docs/benchmarks.md.

    python bench/variants.py
    python bench/variants.py --workloads mobilenet_v2 --repeats 9
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import methods as M  # noqa: E402
from bench.pairing import paired_overhead  # noqa: E402
from bench.run import fixed_bytes, log, measure_eager, write_result  # noqa: E402
from monet_cli.core.plan import solve_schedule  # noqa: E402
from monet_cli.core.profile import Profile  # noqa: E402
from monet_cli.core.segments import SegmentModel  # noqa: E402
from monet_cli.core.solver.search import Planner  # noqa: E402
from monet_cli.profiler.run import profile_model  # noqa: E402
from monet_cli.runtime.compare import check_gradients  # noqa: E402
from monet_cli.workload.resolve import Overrides, resolve_model_spec  # noqa: E402

WORKLOADS = ("resnet50", "mobilenet_v2", "unet")
CURVES = {"variants": True, "checkpointing only": False}


def budgets(baseline_peak: int, fixed: int, lowest: int) -> list[tuple[str, int]]:
    """(label, bytes), largest first: 90% of the baseline peak down in 10% steps, the peak of
    3x less activation memory (activations: the peak minus ``fixed``), each above the
    smallest peak ``lowest``; then ``lowest``."""
    chosen = [(f"{pct}%", baseline_peak * pct // 100) for pct in range(90, 0, -10)]
    third = fixed + (baseline_peak - fixed) // 3
    if third not in {size for _, size in chosen}:
        chosen.append(("3x", third))
    return sorted((b for b in chosen if b[1] > lowest), key=lambda b: -b[1]) + [("min", lowest)]


def curve(profile: Profile, *, variants: bool, time_limit: float, workers: int, gap: float) -> list[tuple[Any, dict]]:
    """Schedules from 90% of the baseline peak down to the smallest peak the solver reaches,
    and at the peak of 3x less activation memory."""
    planner = Planner(SegmentModel(profile), variants=variants)
    lowest = planner.minimum_peak(time_limit_s=time_limit, workers=workers, seed=0).peak_bytes
    points = []
    for spec, budget in budgets(profile.baseline.peak_bytes, fixed_bytes(profile), lowest):
        schedule, outcome = solve_schedule(
            planner, budget, spec, time_limit_s=time_limit, workers=workers, seed=0, relative_gap=gap
        )
        log(f"{'variants' if variants else 'checkpointing'} {spec}: {outcome.status} in {outcome.time_s:.2f}s")
        if schedule is not None:
            points.append(
                (
                    schedule,
                    {
                        "budget_spec": spec,
                        "budget_bytes": budget,
                        "predicted_peak_bytes": schedule.predicted.peak_bytes,
                        "predicted_overhead": schedule.predicted.overhead,
                        "status": outcome.status,
                        "gap": outcome.gap,
                        "gap_limit": gap,
                        "solve_time_s": outcome.time_s,
                        "segments": len(schedule.segments),
                        "kept_ops": len(schedule.keeps),
                        "variants": len(schedule.variants),
                    },
                )
            )
    return points


def run_workload(
    name: str, device: torch.device, *, repeats: int, time_limit: float, workers: int, gap: float
) -> dict[str, Any]:
    spec = resolve_model_spec(name, Overrides(), configs_dir=ROOT / "configs")
    log(f"{name}: profiling")
    profile = profile_model(spec, device, steps=3)
    fixed = fixed_bytes(profile)
    methods, checks = [M.baseline(spec, device)], {}
    for label, variants in CURVES.items():
        for schedule, info in curve(profile, variants=variants, time_limit=time_limit, workers=workers, gap=gap):
            method = M.monet(spec, device, schedule, {**info, "curve": label})
            method.name = f"{label} {schedule.budget_spec}"
            methods.append(method)
            if schedule.variants:
                log(f"{name}: gradient check of {method.name}")
                checks[method.name] = check_gradients(schedule, device)
    log(f"{name}: measuring {len(methods)} methods x {repeats} repeats")
    measured = measure_eager(methods, repeats)
    base = measured[methods[0].name]
    points = []
    for method in methods:
        row = {"method": method.name, "kind": method.kind, **measured[method.name], **method.info}
        row["overhead"] = paired_overhead(row["step_ms_all"], base["step_ms_all"])
        row["activation_ratio"] = (base["peak_bytes"] - fixed) / max(1, row["peak_bytes"] - fixed)
        if "predicted_peak_bytes" in row:
            row["prediction_error"] = (row["predicted_peak_bytes"] - row["peak_bytes"]) / row["peak_bytes"]
            row["within_budget"] = row["peak_bytes"] <= row["budget_bytes"]
        check = checks.get(method.name)
        if check is not None:
            row["check"] = {
                "ok": check.ok,
                "mode": check.mode,
                "rtol": check.rtol,
                "atol": check.atol,
                "max_relative_diff": check.max_relative_diff,
                "buffers_match": check.buffers_match,
            }
        points.append(row)
    sites = [
        {"impl": v.impl, "module": v.module, "time_ms": v.time_ms, "saves_bytes": v.native_saved_bytes - v.saved_bytes}
        for v in profile.variants
    ]
    return {
        "workload": name,
        "device": device.type,
        "device_name": profile.device.name,
        "spec": {"model": spec.target, "batch_size": spec.batch_size, "inputs": [list(i.shape) for i in spec.inputs]},
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "repeats": repeats,
        "profile": {
            "baseline_peak_bytes": profile.baseline.peak_bytes,
            "step_ms": profile.baseline.step_ms,
            "fixed_bytes": fixed,
            "variant_sites": sites,
        },
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "points": points,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--gap",
        type=float,
        default=0.01,
        help="relative gap at which each solve stops (monet solve's default; 0: prove each optimal)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args(argv)
    device = torch.device("cpu")
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.workloads.split(","):
        result = run_workload(
            name, device, repeats=args.repeats, time_limit=args.time_limit, workers=args.workers, gap=args.gap
        )
        write_result(args.out / f"variants-{name}-{device.type}.json", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
