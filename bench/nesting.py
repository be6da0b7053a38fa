"""What nested segments add: the smallest reachable peak with and without them, and the
nested floor schedule applied and measured.

Per workload: the smallest peak the solver reaches when segments may not nest, the same with
nesting, the pairs the nested floor uses, then that schedule (budget = its predicted peak)
run once against the unmodified model: measured peak, prediction error and gradients.
Results go to bench/results/nesting-cpu.json; bench/report.py renders them.

    python bench/nesting.py                        # shipped profiles plus the GPT-2 and LLaMA reproductions
    python bench/nesting.py --workloads gpt2,llama
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from monet_cli.core.plan import build_schedule  # noqa: E402
from monet_cli.core.profile import InputSpec, Profile, load_profile  # noqa: E402
from monet_cli.core.schedule import SolverInfo  # noqa: E402
from monet_cli.core.segments import SegmentModel  # noqa: E402
from monet_cli.core.solver.linear import nested_pairs  # noqa: E402
from monet_cli.core.solver.search import Planner  # noqa: E402
from monet_cli.profiler.run import profile_model  # noqa: E402
from monet_cli.runtime.compare import run_apply  # noqa: E402
from monet_cli.runtime.fingerprint import torch_version  # noqa: E402
from monet_cli.workload.resolve import Overrides, resolve_model_spec  # noqa: E402

CPU = torch.device("cpu")
REPRODUCTIONS = {
    # The real-models issue's two models, at its size: batch 16 x 128 tokens.
    "gpt2": "tests.models_for_tests:hf_gpt2",
    "llama": "tests.models_for_tests:hf_llama",
}
SHIPPED = ("gpt", "unet", "mobilenet_v2", "resnet50")


class FlatSegments(SegmentModel):
    """The segment model without nesting: what the solver could do before."""

    nest_pairs = ()


def load(name: str) -> Profile:
    if name in SHIPPED:
        shipped = load_profile(ROOT / "configs" / f"{name}.profile.yaml")
        if shipped.fingerprint.torch == torch_version():
            return shipped
        # Made with another torch: its schedules would be refused here, so measure anew.
        return profile_model(shipped.model, CPU, steps=1)
    spec = resolve_model_spec(REPRODUCTIONS[name], Overrides(
        batch_size=16, loss="token_cross_entropy",
        inputs=(InputSpec(shape=(128,), dtype="int64", low=0, high=1000),),
    ))
    return profile_model(spec, CPU, steps=1)


def measure(name: str, time_limit_s: float, workers: int) -> dict:
    profile = load(name)
    # Segments alone on both sides: this measures what nesting adds, not the operator variants.
    flat = Planner(FlatSegments(profile), variants=False).minimum_peak(time_limit_s=time_limit_s, workers=workers,
                                                                       seed=0)
    start = time.perf_counter()
    model = SegmentModel(profile)
    floor = Planner(model, variants=False).minimum_peak(time_limit_s=time_limit_s, workers=workers, seed=0)
    solve_s = time.perf_counter() - start
    info = SolverInfo(method="minimum-peak", status="n/a", objective=None, bound=None, gap=None, time_s=solve_s,
                      workers=workers, seed=0, time_limit_s=time_limit_s, ortools="")
    schedule = build_schedule(profile, floor.plan, budget_bytes=floor.peak_bytes, budget_spec="floor", solver=info,
                              profile_sha256="", model=model)
    report = run_apply(schedule, CPU, steps=1, check=True)
    measured = report.measured_peak_bytes
    return {
        "workload": name, "model": profile.model.name, "baseline_peak_bytes": profile.baseline.peak_bytes,
        "flat_floor_bytes": flat.peak_bytes, "nested_floor_bytes": floor.peak_bytes,
        "nested_pairs": [[model.segments[o].fqn, model.segments[i].fqn] for o, i in nested_pairs(model, floor.plan)],
        "candidate_pairs": len(model.nest_pairs), "measured_peak_bytes": measured,
        "error": (floor.peak_bytes - measured) / measured, "within_budget": measured <= floor.peak_bytes,
        "grads_equal": report.check.grads_match and report.check.params_match and report.check.buffers_match,
        "predicted_overhead": schedule.predicted.overhead, "solve_s": round(solve_s, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default=",".join((*SHIPPED, *REPRODUCTIONS)))
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "nesting-cpu.json")
    args = parser.parse_args()
    rows = []
    for name in args.workloads.split(","):
        rows.append(measure(name, args.time_limit, args.workers))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"torch": torch.__version__, "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
