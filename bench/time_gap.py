"""Where a checkpointed step's added time goes, measured inside real steps.

The time model prices a schedule as the wall time of the forward code it re-runs (each module
call timed in the profile's plain steps) plus the checkpoint machinery ``monet profile`` prices
(a frame, a re-run op's extra and the selective policy timed in the model's own step where
steps are short, saved tensors on a synthetic chain). This bench checks each part against a real step. Per workload:
one fresh profile; the schedule that checkpoints every block (no ops kept); the unmodified step
and the scheduled one timed interleaved, phase by phase (forward, backward, optimizer step).
Inside the scheduled backward, a wrapper times each block's recompute (its forward called again
by checkpoint), with no dispatch mode in the way, so the recompute's wall time is measured
apart from the rest of backward (unpacking, the engine's own work). Results go to
bench/results/time-gap-cpu.json; ``bench/report.py`` renders them.

    python bench/time_gap.py
    python bench/time_gap.py --workloads gpt --repeats 30
"""

from __future__ import annotations

import argparse
import functools
import re
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.reach import BLOCKS  # noqa: E402
from bench.run import log, write_rows  # noqa: E402
from monet_cli.core.plan import build_schedule  # noqa: E402
from monet_cli.core.schedule import SolverInfo  # noqa: E402
from monet_cli.core.segments import SegmentModel  # noqa: E402
from monet_cli.core.simulate import simulate  # noqa: E402
from monet_cli.profiler.run import profile_model  # noqa: E402
from monet_cli.runtime.executor import apply_schedule  # noqa: E402
from monet_cli.workload.resolve import Overrides, resolve_model_spec  # noqa: E402
from monet_cli.workload.step import Workload, build_workload  # noqa: E402

CPU = torch.device("cpu")
PHASES = ("forward", "backward", "optimizer")


class RecomputeClock:
    """Wall time of block forwards that run while autograd's engine runs: checkpoint's recomputes.
    Installed before the schedule: checkpoint re-runs the forward it wrapped, not ``module(...)``,
    so module hooks would not see the recompute, while a wrapped ``forward`` is what it re-runs."""

    def __init__(self, model: torch.nn.Module, fqns: set[str]) -> None:
        self.total_ms = 0.0
        for fqn, module in model.named_modules():
            if fqn in fqns:
                module.forward = self._timed(module.forward)

    def _timed(self, forward: Any) -> Any:
        @functools.wraps(forward)
        def run(*args: Any, **kwargs: Any) -> Any:
            if torch._C._current_graph_task_id() == -1:  # the forward itself
                return forward(*args, **kwargs)
            start = time.perf_counter()
            try:
                return forward(*args, **kwargs)
            finally:
                self.total_ms += (time.perf_counter() - start) * 1000.0

        return run


def timed_phases(workload: Workload, seed: int, clock: RecomputeClock | None = None) -> dict[str, float]:
    """One step's forward, backward and optimizer wall times in ms, the recompute's, and the
    minor page faults the process took in the step (memory the OS had to map afresh)."""
    marks: dict[str, float] = {}

    def mark(phase: str, _loss: torch.Tensor) -> None:
        workload.sync()
        marks[phase] = time.perf_counter()

    if clock is not None:
        clock.total_ms = 0.0
    torch.manual_seed(seed)
    workload.zero_grad()
    workload.sync()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    workload.step(mark)
    workload.sync()
    end = time.perf_counter()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return {
        "forward": (marks["backward"] - start) * 1000.0,
        "backward": (marks["optimizer"] - marks["backward"]) * 1000.0,
        "optimizer": (end - marks["optimizer"]) * 1000.0,
        "recompute": clock.total_ms if clock else 0.0,
        "faults": faults,
    }


def measure(name: str, repeats: int) -> dict[str, Any]:
    spec = resolve_model_spec(name, Overrides(), configs_dir=ROOT / "configs")
    log(f"{name}: profiling")
    profile = profile_model(spec, CPU, steps=3)
    model = SegmentModel(profile)
    plan = {c: frozenset() for c, seg in model.segments.items() if re.fullmatch(BLOCKS[name], seg.fqn)}
    predicted = simulate(profile, plan, model=model)
    schedule = build_schedule(
        profile,
        plan,
        budget_bytes=predicted.peak_bytes,
        budget_spec="every block",
        solver=SolverInfo.not_solved("every block"),
        profile_sha256="",
        model=model,
    )
    plain, scheduled = build_workload(spec, CPU), build_workload(spec, CPU)
    clock = RecomputeClock(scheduled.model, {model.segments[c].fqn for c in plan})
    apply_schedule(scheduled.model, schedule)
    log(f"{name}: {len(plan)} blocks, {repeats} interleaved repeats")
    for seed in range(2):  # warm-up: the optimizer's state, the allocator's caches
        timed_phases(plain, seed)
        timed_phases(scheduled, seed, clock)
    runs: dict[str, list[dict[str, float]]] = {"plain": [], "scheduled": []}
    for r in range(repeats):
        pair = [("plain", plain, None), ("scheduled", scheduled, clock)]
        for key, workload, c in pair if r % 2 == 0 else reversed(pair):
            runs[key].append(timed_phases(workload, r, c))
    medians = {
        key: {phase: statistics.median(run[phase] for run in rows) for phase in (*PHASES, "recompute", "faults")}
        for key, rows in runs.items()
    }
    steps = {key: [sum(run[p] for p in PHASES) for run in rows] for key, rows in runs.items()}
    recompute_ops_ms = sum(model.recompute_ms(c) for c in plan)
    return {
        "workload": name,
        "model": profile.model.name,
        "batch_size": profile.model.batch_size,
        "blocks": len(plan),
        "repeats": repeats,
        "profile_step_ms": profile.baseline.step_ms,
        "predicted_recompute_ops_ms": recompute_ops_ms,
        "predicted_machinery_ms": predicted.added_ms - recompute_ops_ms,
        # Both steps run the prepared model (activations out of place): the decisions' time alone.
        "predicted_overhead": predicted.added_ms / profile.baseline.step_ms,
        "plain": medians["plain"],
        "scheduled": medians["scheduled"],
        "plain_step_ms": statistics.median(steps["plain"]),
        "scheduled_step_ms": statistics.median(steps["scheduled"]),
        "plain_step_ms_all": [round(t, 3) for t in steps["plain"]],
        "scheduled_step_ms_all": [round(t, 3) for t in steps["scheduled"]],
        "recomputed_ops": sum(model.segments[c].stop - model.segments[c].first_op for c in plan),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="gpt,resnet50,unet")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "time-gap-cpu.json")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    write_rows(args.out, [measure(name, args.repeats) for name in args.workloads.split(",")])


if __name__ == "__main__":
    main()
