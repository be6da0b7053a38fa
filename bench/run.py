"""monet side by side with what users would pick instead, measured in one process.

For each workload: the unmodified step, PyTorch checkpointing of every block and of every
k-th block, torch.compile's activation_memory_budget (transformers), and monet schedules
from 90% of the baseline peak down to the smallest feasible budget in 10% steps, plus one
at the measured peak of each checkpoint-every-k method (the same memory, to compare time), each
solve stopping within 1% of the fastest, as ``monet solve`` does by default (``--gap``). Eager
methods are timed interleaved (each repeat runs every method once, in rotating order);
compiled ones in a block of their own after a dynamo reset. Results go to
bench/results/<workload>-<device>.json; ``bench/report.py`` turns them into
docs/benchmarks.md and plots.

    python bench/run.py                      # every workload, full budgets
    python bench/run.py --workloads gpt,unet --repeats 5
    python bench/run.py --smoke --out /tmp/x # CI: one tiny workload, one budget
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import platform
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import methods as M  # noqa: E402
from bench.pairing import paired_overhead  # noqa: E402
from monet_cli.core.plan import plan_of, predicted, predicted_for, solve_schedule, variants_of  # noqa: E402
from monet_cli.core.profile import InputSpec, Profile  # noqa: E402
from monet_cli.core.segments import SegmentModel  # noqa: E402
from monet_cli.core.simulate import SimResult, simulate  # noqa: E402
from monet_cli.core.solver.search import Hint, Planner  # noqa: E402
from monet_cli.profiler.run import env_info, profile_model  # noqa: E402
from monet_cli.profiler.window import WindowTimer  # noqa: E402
from monet_cli.runtime.host_memory import keep_freed_host_memory  # noqa: E402
from monet_cli.runtime.meter import measure_peak  # noqa: E402
from monet_cli.runtime.sharing import others_busy_since, read_cpu_times, usable_cpus  # noqa: E402
from monet_cli.workload.resolve import Overrides, resolve_model_spec  # noqa: E402
from monet_cli.workload.step import build_workload  # noqa: E402


@dataclass(frozen=True)
class Workload:
    name: str
    model: str
    overrides: Overrides
    block_types: tuple[str, ...]
    transformer: bool
    repeats: int = 3
    """Interleaved timed repeats of every method: as many as fit in minutes (a step's repeats
    spread 20-100% on a 2-core CPU, and the issues' time targets are a few points). With 41,
    the 90% interval of a point's paired overhead was 5 to 15 points wide on tiny_gpt and the
    unet; 101 narrow it by about 1.6x."""


WORKLOADS = {
    "resnet50": Workload("resnet50", "resnet50", Overrides(), ("Bottleneck",), False, repeats=21),
    "vit_b_16": Workload("vit_b_16", "vit_b_16", Overrides(), ("EncoderBlock",), True, repeats=5),
    "gpt": Workload("gpt", "gpt", Overrides(), ("GPTBlock",), True, repeats=101),
    "unet": Workload("unet", "unet", Overrides(), ("Sequential",), False, repeats=101),
}
SMOKE = Workload(
    "smoke",
    "monet_cli.examples.models:skip_concat_net",
    Overrides(batch_size=4, inputs=(InputSpec(shape=(3, 32, 32)),)),
    ("Sequential",),
    False,
)


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def monet_points(
    planner: Planner, fractions: list[int], at_peaks: list[tuple[str, int]], time_limit: float, workers: int, gap: float
) -> list[tuple[Any, dict]]:
    """Solve each budget (percent of the baseline peak) until one is infeasible, then one budget
    at each of ``at_peaks`` (a method's measured peak: monet against it at equal memory)."""
    profile = planner.profile
    points = []
    budgets = [(f"{pct}%", profile.baseline.peak_bytes * pct // 100) for pct in fractions]
    hint = None
    while budgets:
        spec, budget = budgets.pop(0)
        point = _solve_point(planner, spec, budget, time_limit, workers, gap, hint)
        if point is None:
            if spec != "min":  # end the curve at the smallest peak any schedule reaches
                lowest = planner.minimum_peak(time_limit_s=time_limit, workers=workers, seed=0)
                if not points or lowest.peak_bytes < points[-1][1]["budget_bytes"]:
                    budgets, hint = [("min", lowest.peak_bytes)], (lowest.plan, lowest.variants)
            continue
        points.append(point)
    points += [
        point
        for spec, budget in at_peaks
        if (point := _solve_point(planner, spec, budget, time_limit, workers, gap)) is not None
    ]
    return points


def _solve_point(
    planner: Planner, spec: str, budget: int, time_limit: float, workers: int, gap: float, hint: Hint | None = None
) -> tuple[Any, dict] | None:
    schedule, outcome = solve_schedule(
        planner, budget, spec, time_limit_s=time_limit, workers=workers, seed=0, relative_gap=gap, hint=hint
    )
    log(f"monet {spec}: {outcome.status} in {outcome.time_s:.2f}s")
    if schedule is None:
        return None
    return schedule, {
        "budget_bytes": budget,
        "predicted_peak_bytes": schedule.predicted.peak_bytes,
        "predicted_overhead": schedule.predicted.overhead,
        "predicted_overhead_op_sums": op_sum_overhead(
            planner.model, plan_of(schedule, planner.model), variants_of(schedule, planner.profile)
        ),
        "solve_time_s": outcome.time_s,
        "status": outcome.status,
        "gap": outcome.gap,
        "gap_limit": gap,
        "segments": len(schedule.segments),
        "kept_ops": len(schedule.keeps),
        "plan": [[s.module, len(schedule.kept_in(s.module))] for s in schedule.segments],
    }


def simulated(model: SegmentModel, checkpointed: list[str]) -> dict[str, Any]:
    """The simulator's peak and overhead for checkpointing the modules ``checkpointed``, each a
    whole segment with nothing kept: the time model checked on the plans people write by hand."""
    profile = model.profile
    plan = {
        seg.call: frozenset()
        for seg in model.segments.values()
        if not seg.members and not seg.range and seg.fqn in checkpointed
    }
    if len(plan) != len(checkpointed):
        raise ValueError(f"{len(checkpointed) - len(plan)} of the checkpointed blocks are not segments of the profile")
    # These methods run the model as written, under PyTorch's checkpoint alone: no preparation
    # and none of a schedule's checks to pay, the same step to compare with.
    result = simulate(_without_checks(profile), plan, model=model)
    reference = profile.baseline.reference_step_ms
    return {
        "predicted_peak_bytes": result.peak_bytes,
        "predicted_overhead": result.added_ms / reference,
        "predicted_overhead_op_sums": _op_sums(model, plan, checks=False).added_ms / reference,
    }


def _without_checks(profile: Profile) -> Profile:
    return replace(profile, overheads=replace(profile.overheads, checks_ms=0.0))


def op_sum_overhead(model: SegmentModel, plan: dict, variants: frozenset[int] = frozenset()) -> float:
    """The overhead the time model before the calls' wall times predicts for the same schedule (a
    recompute priced at its ops' timed sum): both models against one measurement."""
    return predicted(_unwalled(model).profile, _op_sums(model, plan, variants)).overhead


def _op_sums(
    model: SegmentModel, plan: dict, variants: frozenset[int] = frozenset(), *, checks: bool = True
) -> SimResult:
    """``plan`` with each recompute priced at its ops' timed sum; ``checks``: a schedule's,
    which PyTorch's own checkpoint does not run."""
    unwalled = _unwalled(model)
    profile = unwalled.profile if checks else _without_checks(unwalled.profile)
    return simulate(profile, plan, model=unwalled, variants=variants)


@functools.cache
def _unwalled(model: SegmentModel) -> SegmentModel:
    profile = model.profile
    calls = tuple(replace(call, time_ms=None) for call in profile.calls)
    return SegmentModel(replace(profile, calls=calls), offer_offloads=False, like=model)


def live_peak(method: M.Method) -> int:
    return measure_peak(method.workload).peak_bytes


def settled_peak(method: M.Method) -> int:
    """The peak of a step after a first one (the optimizer's state exists), as ``measure_eager`` takes it."""
    method.workload.timed_step(seed=0)
    return live_peak(method)


def measure_eager(
    methods: list[M.Method], repeats: int, window: WindowTimer | None = None
) -> dict[str, dict[str, Any]]:
    """Each method's peak and its steps, timed in ``repeats`` rounds of one step each, in
    rotating order; ``window`` times the profile's step and calls once a round."""
    for m in methods:
        m.workload.timed_step(seed=0)  # warm-up
    peaks = {m.name: live_peak(m) for m in methods}
    times: dict[str, list[float]] = {m.name: [] for m in methods}
    for r in range(repeats):
        order = methods[r % len(methods) :] + methods[: r % len(methods)]
        for m in order:
            times[m.name].append(m.workload.timed_step(seed=r))
        if window is not None:
            window.tick(as_written_ms=times[methods[0].name][-1])
    return {
        m.name: {
            "peak_bytes": peaks[m.name],
            "step_ms": statistics.median(times[m.name]),
            "step_ms_all": [round(t, 3) for t in times[m.name]],
        }
        for m in methods
    }


def measure_compiled(spec, device, budgets: list[float], repeats: int, baseline: M.Method) -> list[dict[str, Any]]:
    eager_profiler = M.profiler_peak(baseline.workload.step, baseline.workload)
    eager_live = live_peak(baseline)
    rows = []
    for budget in budgets:
        try:
            method = M.compiled(spec, device, budget)
            method.workload.timed_step(seed=0)  # compiles
            raw = M.profiler_peak(method.workload.step, method.workload)
            times = [method.workload.timed_step(seed=r) for r in range(repeats)]
            base_times = [baseline.workload.timed_step(seed=r) for r in range(repeats)]
        except Exception as err:  # report, do not hide: e.g. BatchNorm models fail to partition
            rows.append(
                {
                    "method": f"compile budget {budget}",
                    "kind": "compile",
                    "error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}",
                }
            )
            continue
        rows.append(
            {
                "method": method.name,
                "kind": "compile",
                "meter": "profiler-counter",
                "profiler_peak_bytes": raw,
                "eager_profiler_peak_bytes": eager_profiler,
                "peak_bytes": raw - eager_profiler + eager_live,
                "step_ms": statistics.median(times),
                "baseline_step_ms_same_block": statistics.median(base_times),
                "info": method.info,
            }
        )
    torch._dynamo.reset()
    return rows


def run_workload(
    w: Workload,
    device: torch.device,
    *,
    repeats: int,
    fractions: list[int],
    time_limit: float,
    workers: int,
    gap: float,
    compile_budgets: list[float],
    steps: int,
    at_block_peaks: bool,
) -> dict[str, Any]:
    spec = resolve_model_spec(w.model, w.overrides, configs_dir=ROOT / "configs")
    log(f"{w.name}: profiling")
    profile = profile_model(spec, device, steps=steps)
    fixed = fixed_bytes(profile)
    eager = [M.baseline(spec, device)]
    for k in (1, 2, 3):
        try:
            eager.append(M.checkpoint_every(spec, device, w.block_types, k))
        except ValueError as err:
            log(str(err))
    log(f"{w.name}: solving")
    at_peaks = [(f"at {m.name}", settled_peak(m)) for m in eager[1:]] if at_block_peaks else []
    planner = Planner(SegmentModel(profile))
    solved = monet_points(planner, fractions, at_peaks, time_limit, workers, gap)
    log(f"{w.name}: building methods")
    eager += [M.monet(spec, device, schedule, info) for schedule, info in solved]
    log(f"{w.name}: measuring {len(eager)} eager methods x {repeats} repeats")
    window = WindowTimer(profile)
    window.start(build_workload(spec, device))
    cpu_times = read_cpu_times()
    measured = measure_eager(eager, repeats, window)
    other_work = others_busy_since(cpu_times)
    base = measured[eager[0].name]
    window_profile = window.in_window()
    window_model = SegmentModel(window_profile)
    for schedule, info in solved:
        info["predicted_overhead_in_window"] = predicted_for(schedule, window_profile, window_model).overhead
    points = []
    for m in eager:
        row = {"method": m.name, "kind": m.kind, "meter": m.meter, **measured[m.name], "info": {}}
        if m.kind == "monet":
            row.update(m.info)
        else:
            row["info"] = m.info
        if m.kind == "pytorch":
            row.update(simulated(planner.model, m.info["checkpointed"]))
            row["predicted_overhead_in_window"] = simulated(window_model, m.info["checkpointed"])["predicted_overhead"]
        points.append(row)
    if w.transformer and compile_budgets:
        log(f"{w.name}: torch.compile budgets {compile_budgets}")
        points += measure_compiled(spec, device, compile_budgets, repeats, eager[0])
    for row in points:
        if "peak_bytes" not in row:
            continue
        if "baseline_step_ms_same_block" in row:  # compiled: timed in a block of its own
            row["overhead"] = row["step_ms"] / row["baseline_step_ms_same_block"] - 1
        else:
            row["overhead"] = paired_overhead(row["step_ms_all"], base["step_ms_all"])
        row["total_ratio"] = base["peak_bytes"] / row["peak_bytes"]
        row["activation_bytes"] = row["peak_bytes"] - fixed
        row["activation_ratio"] = (base["peak_bytes"] - fixed) / max(1, row["peak_bytes"] - fixed)
        if "predicted_peak_bytes" in row:
            row["prediction_error"] = (row["predicted_peak_bytes"] - row["peak_bytes"]) / row["peak_bytes"]
        if "budget_bytes" in row:
            row["within_budget"] = row["peak_bytes"] <= row["budget_bytes"]
    return {
        "workload": w.name,
        "device": device.type,
        "device_name": profile.device.name,
        "spec": {
            "model": spec.target,
            "batch_size": spec.batch_size,
            "inputs": [list(i.shape) for i in spec.inputs],
            "optimizer": spec.optimizer.name,
        },
        "machine": {
            "cpus": torch.get_num_threads(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "host_memory_kept": keep_freed_host_memory(),
        },  # profile_model set it: this says whether it took
        "env": {k: str(v) for k, v in vars(env_info()).items()}
        if hasattr(env_info(), "__dict__")
        else {f: str(getattr(env_info(), f)) for f in ("monet", "torch", "torchvision", "ortools", "python")},
        "profile": {
            "baseline_peak_bytes": profile.baseline.peak_bytes,
            "step_ms": profile.baseline.step_ms,
            "as_written_step_ms": profile.baseline.as_written_step_ms,
            "forward_ops": len(profile.ops),
            "segments": sum(c.checkpointable for c in profile.calls),
            "fixed_bytes": fixed,
            "overheads": dataclasses.asdict(profile.overheads),
        },
        "window_step_ms": window_profile.baseline.step_ms,
        "repeats": repeats,
        "other_work_cpus": other_work,
        "usable_cpus": len(usable_cpus()),
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "points": points,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--device", default="auto")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats (default: each workload's own)")
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--gap",
        type=float,
        default=0.01,
        help="relative gap at which each solve stops (monet solve's default; 0: prove each optimal)",
    )
    parser.add_argument("--smoke", action="store_true", help="one tiny workload, one budget (CI)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args(argv)
    from monet_cli.workload.step import resolve_device

    device = resolve_device(args.device)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    args.out.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        jobs = [
            (
                SMOKE,
                dict(
                    repeats=1,
                    fractions=[90],
                    time_limit=10.0,
                    workers=1,
                    gap=args.gap,
                    compile_budgets=[],
                    steps=1,
                    at_block_peaks=False,
                ),
            )
        ]
    else:
        jobs = [
            (
                WORKLOADS[name],
                dict(
                    repeats=args.repeats or WORKLOADS[name].repeats,
                    fractions=list(range(90, 0, -10)),
                    time_limit=args.time_limit,
                    workers=args.workers,
                    gap=args.gap,
                    compile_budgets=[0.5, 0.1],
                    steps=3,
                    at_block_peaks=True,
                ),
            )
            for name in args.workloads.split(",")
        ]
    for workload, options in jobs:
        write_result(args.out / f"{workload.name}-{device.type}.json", run_workload(workload, device, **options))
    return 0


def fixed_bytes(profile: Profile) -> int:
    """Parameters, gradients and optimizer state: what no schedule changes."""
    memory = profile.memory
    return memory.param_bytes + memory.grad_bytes + memory.optimizer_state_bytes


def write_result(path: Path, result: dict[str, Any]) -> None:
    path.write_text(json.dumps(result, indent=2) + "\n")
    log(f"wrote {path}")


def write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    """A sweep's rows, with the torch that measured them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_result(path, {"torch": torch.__version__, "rows": rows})


if __name__ == "__main__":
    raise SystemExit(main())
