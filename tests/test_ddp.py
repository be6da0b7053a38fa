"""A scheduled model under DistributedDataParallel (2 processes, gloo, CPU) matches the unscheduled one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from conftest import small_spec
from monet_cli.core.plan import build_schedule
from monet_cli.core.schedule import SolverInfo, save_schedule
from monet_cli.core.segments import SegmentModel
from monet_cli.core.solver.heuristics import level_plans
from monet_cli.profiler.run import profile_model

ROOT = Path(__file__).resolve().parent.parent


def test_ddp_two_processes_same_gradients(tmp_path: Path):
    profile = profile_model(small_spec("resnet18", shape=(3, 32, 32), batch_size=2), torch.device("cpu"), steps=1)
    model = SegmentModel(profile)
    plan = max(level_plans(model).values(), key=len)
    plan = {c: frozenset(model.segments[c].candidates[:1]) for c in plan}  # some kept ops too
    info = SolverInfo(method="test", status="n/a", objective=None, bound=None, gap=None, time_s=0.0, workers=1,
                      seed=0, time_limit_s=0.0, ortools="")
    path = tmp_path / "ddp.yaml"
    save_schedule(build_schedule(profile, plan, budget_bytes=2 * profile.baseline.peak_bytes, budget_spec="200%",
                                 solver=info, profile_sha256="",
                                 model=model), path)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(ROOT / "tests" / "ddp_worker.py"), str(path), str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["world"] == 2 for r in reports)
    assert all(r["equal"] for r in reports), reports
