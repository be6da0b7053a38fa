"""`make gpu-check`: the whole loop on a CUDA GPU, with one summary of what it measured.

First the pytest ``gpu`` marker. Then, for each workload: profile on the GPU, find the
smallest reachable peak, solve at 60% of the baseline (halfway down to the smallest peak when
60% cannot be reached) and just above the smallest peak, then ``apply --check`` each schedule
beside the unmodified model. Writes bench/results/gpu-check.json and docs/gpu.md after each
workload, so that a run cut short still leaves what it measured.

Without a CUDA GPU it writes nothing and exits 9 (monet's "device not available" code): a
GPU result is never claimed where none was measured. It needs OR-Tools; a machine without
network access gets it from wheels made here with ``make gpu-wheels``.

    python bench/gpu_check.py                       # every workload
    python bench/gpu_check.py --workloads gpt --skip-pytest --save /tmp/plans --workers 8
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from monet_cli.core.yamlio import atomic_write_text  # noqa: E402
from monet_cli.errors import EXIT_DEVICE  # noqa: E402
from monet_cli.runtime.meter import alloc_conf  # noqa: E402

TIME_LIMIT_S = 20.0
WORKLOADS = {
    # name: (model, batch, per-sample input shape, precision, extra overrides)
    "resnet50": ("resnet50", 64, (3, 224, 224), "bf16-mixed", {}),
    "gpt": ("gpt", None, None, "32", {}),
    "llama": (
        "hf:llama",
        8,
        (256,),
        "bf16-mixed",
        {
            "model_kwargs": {
                "vocab_size": 32000,
                "hidden_size": 512,
                "intermediate_size": 1408,
                "num_hidden_layers": 8,
                "num_attention_heads": 8,
                "num_key_value_heads": 4,
                "max_position_embeddings": 256,
            }
        },
    ),
}


def _spec(name: str):
    from monet_cli.core.profile import InputSpec
    from monet_cli.workload.resolve import Overrides, resolve_model_spec

    model, batch, shape, precision, extra = WORKLOADS[name]
    # hf: models build their own token inputs from the sequence length.
    inputs = None if shape is None else (InputSpec(shape=shape),)
    return resolve_model_spec(model, Overrides(batch_size=batch, inputs=inputs, precision=precision, **extra))


def run_workload(name: str, device: torch.device, *, workers: int = 2, save: Path | None = None) -> dict:
    from bench.real_models import case_budgets
    from monet_cli.core.plan import solve_schedule
    from monet_cli.core.profile import save_profile
    from monet_cli.core.schedule import save_schedule
    from monet_cli.core.segments import SegmentModel
    from monet_cli.core.simulate import simulate
    from monet_cli.core.solver.search import Planner
    from monet_cli.profiler.run import profile_model
    from monet_cli.profiler.window import WindowTimer
    from monet_cli.runtime.compare import run_apply

    start = time.perf_counter()
    profile = profile_model(_spec(name), device, steps=3)
    profile_s = time.perf_counter() - start
    baseline = simulate(profile, {})
    if save is not None:
        save_profile(profile, save / f"{name}.profile.yaml")
    planner = Planner(SegmentModel(profile))
    lowest = planner.minimum_peak(time_limit_s=TIME_LIMIT_S, workers=workers, seed=0)
    runs = []
    for label, budget in case_budgets(profile.baseline.peak_bytes, lowest.peak_bytes).items():
        schedule, outcome = solve_schedule(
            planner,
            budget,
            label,
            time_limit_s=TIME_LIMIT_S,
            workers=workers,
            seed=0,
            hint=(lowest.plan, lowest.variants),
        )
        if schedule is None:
            raise RuntimeError(
                f"no schedule at {label} ({budget} B, smallest peak {lowest.peak_bytes} B): {outcome.status}"
            )
        if save is not None:
            save_schedule(schedule, save / f"{name}-{label}.schedule.yaml")
        report = run_apply(schedule, device, steps=3, check=True, window=WindowTimer(profile))
        check = report.check
        runs.append(
            {
                "budget": label,
                "budget_bytes": budget,
                "solver_status": outcome.status,
                "solve_s": outcome.time_s,
                "predicted_peak_bytes": report.predicted_peak_bytes,
                "requested_peak_bytes": outcome.result.requested_peak_bytes,
                "measured_peak_bytes": report.measured_peak_bytes,
                "baseline_peak_bytes": report.baseline_peak_bytes,
                "error": report.prediction_error,
                "within_budget": report.within_budget,
                "predicted_overhead": report.predicted_overhead,
                "predicted_overhead_here": report.predicted_here.overhead,
                "measured_overhead": report.overhead,
                "grads_ok": check.ok,
                "check": check.describe(),
                "max_grad_diff": check.max_grad_diff,
                "offloads": [o.module for o in schedule.offloads],
            }
        )
    return {
        "workload": name,
        "model": profile.model.name,
        "batch_size": profile.model.batch_size,
        "precision": profile.model.precision,
        "forward_ops": len(profile.ops),
        "profile_s": round(profile_s, 1),
        "baseline_peak_bytes": profile.baseline.peak_bytes,
        "simulated_baseline_bytes": baseline.peak_bytes,
        "requested_baseline_bytes": baseline.requested_peak_bytes,
        "floor_bytes": lowest.peak_bytes,
        "op_ms_sum": round(sum(o.time_ms for o in profile.ops) + sum(o.time_ms for o in profile.backward), 2),
        "baseline_step_ms": profile.baseline.step_ms,
        "transfer": None if profile.transfer is None else dataclasses.asdict(profile.transfer),
        "workspace_ops": sum(1 for o in (*profile.ops, *profile.backward) if o.workspace_bytes),
        "runs": runs,
    }


def run_gpu_tests() -> dict:
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    sys.stderr.write(result.stdout + result.stderr)  # the failures' details, for the log
    tail = (result.stdout.strip().splitlines() or [""])[-1]
    return {"returncode": result.returncode, "summary": tail}


def _offloaded(run: dict) -> str:
    offloads = run.get("offloads")
    return f"; offloads {', '.join(m or '<model>' for m in offloads)}" if offloads else ""


def _mib(nbytes: int | None) -> str:
    """A size in MiB; "n/a" for one a run before 12-05 did not record (the requests' sum)."""
    return "n/a" if nbytes is None else f"{nbytes / 2**20:.2f} MiB"


def _priced_here(run: dict) -> str:
    """The prediction priced again in apply's own run (absent from runs before 12-07)."""
    here = run.get("predicted_overhead_here")
    return "" if here is None else f" ({100 * here:+.1f}%)"


def render(summary: dict) -> str:
    lines = [
        "# monet on a GPU: measured",
        "",
        f"Written by `make gpu-check` on {summary['date']}: {summary['device']}, torch {summary['torch']} "
        f"(CUDA {summary['cuda']}), Python {summary['python']}, PYTORCH_CUDA_ALLOC_CONF "
        f"'{summary['alloc_conf']}'. Measured on that machine, except 'predicted' (the simulator's peak: the "
        "caching allocator's blocks replayed for the step's events, or the requests' sum where every block is "
        "split) and 'requests' (the sum of the requests), both computed from its profiles. 'unmodified': the "
        "model without the schedule, measured beside it.",
        "",
        "| workload | budget | predicted | requests | measured | error | within | unmodified | overhead pred "
        "(priced in the run) / meas | gradients |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for w in summary["workloads"]:
        if "error" in w:
            lines.append(f"| {w['workload']} | failed: {w['error']} | | | | | | | | |")
            continue
        for r in w["runs"]:
            lines.append(
                f"| {w['workload']} ({w['precision']}, batch {w['batch_size']}) | {r['budget']} "
                f"({r['budget_bytes'] / 2**20:.1f} MiB) | {r['predicted_peak_bytes'] / 2**20:.2f} MiB | "
                f"{_mib(r.get('requested_peak_bytes'))} | "
                f"{r['measured_peak_bytes'] / 2**20:.2f} MiB | {100 * r['error']:+.2f}% | {r['within_budget']} | "
                f"{r['baseline_peak_bytes'] / 2**20:.2f} MiB | "
                f"{100 * r['predicted_overhead']:+.1f}%{_priced_here(r)} / {100 * r['measured_overhead']:+.1f}% | "
                f"{'ok' if r['grads_ok'] else 'DIFFER'}: "
                f"{r['check']}{_offloaded(r)} |"
            )
    lines += [
        "",
        "| workload | baseline measured | simulated | requests | smallest peak | op times summed / step "
        "| ops with workspace |",
        "|---|---|---|---|---|---|---|",
    ]
    for w in summary["workloads"]:
        if "error" not in w:
            lines.append(
                f"| {w['workload']} | {w['baseline_peak_bytes'] / 2**20:.2f} MiB | "
                f"{w['simulated_baseline_bytes'] / 2**20:.2f} MiB | {_mib(w.get('requested_baseline_bytes'))} | "
                f"{w['floor_bytes'] / 2**20:.2f} MiB | "
                f"{w['op_ms_sum']:.1f} / {w['baseline_step_ms']:.1f} ms | {w['workspace_ops']} |"
            )
    speeds = [w["transfer"] for w in summary["workloads"] if w.get("transfer")]
    if speeds:  # a property of the machine: every profile measures it, the first one says it
        t = speeds[0]
        lines += [
            "",
            f"Host-device copies (pinned memory, measured by `monet profile`): "
            f"{t['to_host_bytes_per_ms'] / 1e6:.1f} GB/s to the host, "
            f"{t['to_device_bytes_per_ms'] / 1e6:.1f} GB/s to the device, {1000 * t['fixed_ms']:.0f} us per copy.",
        ]
    tests = summary.get("gpu_tests")
    lines += ["", f"pytest -m gpu: {tests['summary'] if tests else 'not run'}", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gpu-check.json")
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "gpu.md")
    parser.add_argument("--skip-pytest", action="store_true")
    parser.add_argument("--workers", type=int, default=2, help="CP-SAT workers per solve")
    parser.add_argument("--save", type=Path, help="also write each profile and schedule into this folder")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        build = f"a CUDA {torch.version.cuda} build" if torch.version.cuda else "a CPU-only build"
        print(
            f"gpu-check: no CUDA GPU visible (torch {torch.__version__}, {build}); nothing measured, nothing written",
            file=sys.stderr,
        )
        return EXIT_DEVICE
    unknown = sorted(set(args.workloads.split(",")) - set(WORKLOADS))
    if unknown:
        parser.error(f"unknown workloads {unknown}; known: {sorted(WORKLOADS)}")
    if args.save is not None:
        args.save.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    summary = {
        "date": dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat(),
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "alloc_conf": alloc_conf(),
        "workers": args.workers,
        "workloads": [],
    }
    # The tests first, and the summary written after each step: a run cut short by a time limit
    # still leaves what it measured.
    summary["gpu_tests"] = None if args.skip_pytest else run_gpu_tests()
    for name in args.workloads.split(","):
        print(f"gpu-check: {name}", file=sys.stderr)
        try:
            summary["workloads"].append(run_workload(name, device, workers=args.workers, save=args.save))
        except Exception as err:  # one workload's failure is a result too: record it, go on
            traceback.print_exc()
            summary["workloads"].append({"workload": name, "error": f"{type(err).__name__}: {err}"})
        torch.cuda.empty_cache()
        write_summary(summary, args.out, args.doc)
    failed = [
        w["workload"]
        for w in summary["workloads"]
        if "error" in w or not all(r["within_budget"] and r["grads_ok"] and abs(r["error"]) <= 0.02 for r in w["runs"])
    ]
    print(
        f"gpu-check: wrote {args.out} and {args.doc}; " + (f"FAILED: {failed}" if failed else "all runs held"),
        file=sys.stderr,
    )
    return 1 if failed or (summary["gpu_tests"] and summary["gpu_tests"]["returncode"] not in (0, 5)) else 0


def write_summary(summary: dict, out: Path, doc: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(summary, indent=2) + "\n")
    atomic_write_text(doc, render(summary))


if __name__ == "__main__":
    sys.exit(main())
