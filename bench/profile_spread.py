"""How far a schedule's predicted overhead moves from one profile to the next, against one
measurement of the same schedules.

The time model's target (measured within 3 points of predicted at every monet point) is
checked by ``bench/run.py`` against one fresh profile per workload; a miss there can be the
model's or that profile's. This bench tells them apart. Per workload: ``--profiles`` fresh
profiles, half before and half after the measurement; schedules solved on the first (at 60%,
50% and 40% of the baseline peak where a schedule reaches it, and at the smallest peak); the
unmodified step and each schedule timed interleaved in rotating order; then each schedule's
plan and operator variants are predicted by every profile, with its added time split into the
parts the time model prices. Results go to bench/results/profile-spread-cpu.json;
``bench/report.py`` renders them.

    python bench/profile_spread.py
    python bench/profile_spread.py --workloads gpt --profiles 6 --repeats 101
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import methods as M  # noqa: E402
from bench.pairing import paired_overhead, paired_ratios  # noqa: E402
from bench.run import WORKLOADS, log, measure_eager, write_rows  # noqa: E402
from monet_cli.core.plan import plan_of, predicted_for, solve_schedule, variants_of  # noqa: E402
from monet_cli.core.profile import Overheads, Profile  # noqa: E402
from monet_cli.core.schedule import Schedule  # noqa: E402
from monet_cli.core.segments import SegmentModel  # noqa: E402
from monet_cli.core.simulate import simulate  # noqa: E402
from monet_cli.core.solver.search import Planner  # noqa: E402
from monet_cli.core.stats import median_interval  # noqa: E402
from monet_cli.profiler.run import profile_model  # noqa: E402
from monet_cli.runtime.host_memory import keep_freed_host_memory  # noqa: E402
from monet_cli.workload.resolve import resolve_model_spec  # noqa: E402

CPU = torch.device("cpu")
FRACTIONS = (60, 50, 40)
CONFIDENCE = 0.9
PARTS = {
    "frames": ("segment_ms",),
    "once": ("first_frame_ms",),
    "checks": ("checks_ms",),
    "saved tensors": ("saved_tensor_ms",),
    "re-run ops": ("python_op_ms",),
    "range tape": ("range_op_ms", "range_record_op_ms"),
    "keep policy": ("policy_op_ms",),
}
"""The machinery's parts of a prediction, each the prices that make it."""


def _schedules(profile: Profile, time_limit: float, workers: int) -> dict[str, Schedule]:
    """The first profile's schedules at ``FRACTIONS`` of its baseline peak and at its smallest peak."""
    planner = Planner(SegmentModel(profile))
    budgets = {f"{pct}%": profile.baseline.peak_bytes * pct // 100 for pct in FRACTIONS}
    lowest = planner.minimum_peak(time_limit_s=time_limit, workers=workers, seed=0)
    schedules = {}
    for spec, budget in [*budgets.items(), ("min", lowest.peak_bytes)]:
        hint = (lowest.plan, lowest.variants) if spec == "min" else None
        schedule, outcome = solve_schedule(
            planner, budget, spec, time_limit_s=time_limit, workers=workers, seed=0, relative_gap=0.01, hint=hint
        )
        log(f"monet {spec}: {outcome.status} in {outcome.time_s:.2f}s")
        if schedule is not None:
            schedules[spec] = schedule
    return schedules


def _without(overheads: Overheads, names: tuple[str, ...]) -> Overheads:
    return replace(overheads, **{name: 0.0 for name in names})


def prediction(profile: Profile, schedule: Schedule) -> dict[str, Any]:
    """``schedule``'s plan and operator variants as ``profile`` predicts them: the overhead, and
    its added time in parts (ms): the recomputes at the calls' walls (every machinery price at 0,
    no variant), the variants' own time, and each machinery part (the added time less the same
    with that part's prices at 0)."""
    chosen = variants_of(schedule, profile)

    def added_ms(overheads: Overheads, variants: frozenset[int] = chosen) -> float:
        priced = replace(profile, overheads=overheads)
        model = SegmentModel(priced)
        return simulate(priced, plan_of(schedule, model), model=model, variants=variants).added_ms

    total_ms = added_ms(profile.overheads)
    unpriced = _without(profile.overheads, tuple(f.name for f in fields(Overheads)))
    parts = {"walls": added_ms(unpriced, frozenset())}
    parts["operator variants"] = added_ms(unpriced) - parts["walls"]
    for part, names in PARTS.items():
        parts[part] = total_ms - added_ms(_without(profile.overheads, names))
    return {
        "overhead": predicted_for(schedule, profile).overhead,
        "added_ms": total_ms,
        "parts_ms": {part: round(ms, 3) for part, ms in parts.items()},
    }


def run_workload(name: str, *, profiles: int, repeats: int, time_limit: float, workers: int) -> dict[str, Any]:
    w = WORKLOADS[name]
    spec = resolve_model_spec(w.model, w.overrides, configs_dir=ROOT / "configs")
    took_s: dict[int, float] = {}

    def profiled(k: int) -> Profile:
        log(f"{name}: profile {k + 1} of {profiles}")
        start = time.perf_counter()
        profile = profile_model(spec, CPU)
        took_s[k] = time.perf_counter() - start
        return profile

    before = [profiled(k) for k in range((profiles + 1) // 2)]
    schedules = _schedules(before[0], time_limit, workers)
    methods = [M.baseline(spec, CPU)] + [M.monet(spec, CPU, s, {}) for s in schedules.values()]
    log(f"{name}: measuring {len(methods)} methods x {repeats} repeats")
    measured = measure_eager(methods, repeats)
    after = [profiled(k) for k in range(len(before), profiles)]
    base = measured[methods[0].name]["step_ms_all"]
    points = []
    for (spec_name, schedule), method in zip(schedules.items(), methods[1:]):
        steps = measured[method.name]["step_ms_all"]
        low, high = median_interval(paired_ratios(steps, base), CONFIDENCE)
        points.append(
            {
                "budget": spec_name,
                "segments": len(schedule.segments),
                "measured_overhead": paired_overhead(steps, base),
                "interval": [low - 1, high - 1],
                "predicted": [prediction(p, schedule) for p in before + after],
            }
        )
    return {
        "workload": name,
        "repeats": repeats,
        "unmodified_step_ms": statistics.median(base),
        "profiles": [
            {
                "when": "before" if k < len(before) else "after",
                "took_s": round(took_s[k], 1),
                "step_ms": p.baseline.step_ms,
                "overheads": {f.name: getattr(p.overheads, f.name) for f in fields(Overheads)},
            }
            for k, p in enumerate(before + after)
        ],
        "points": points,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="gpt,unet")
    parser.add_argument("--profiles", type=int, default=4, help="fresh profiles per workload (at least 2)")
    parser.add_argument("--repeats", type=int, default=61, help="interleaved timed repeats of each schedule")
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "profile-spread-cpu.json")
    args = parser.parse_args(argv)
    if args.profiles < 2:
        parser.error("--profiles must be at least 2")
    keep_freed_host_memory()  # time the steps as the profiles do
    rows = [
        run_workload(
            name, profiles=args.profiles, repeats=args.repeats, time_limit=args.time_limit, workers=args.workers
        )
        for name in args.workloads.split(",")
    ]
    write_rows(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
