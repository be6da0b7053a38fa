"""Scheduled models under DistributedDataParallel and FSDP2 (2 processes, gloo, CPU, torchrun)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import small_spec

from monet_cli.core.schedule import save_schedule
from monet_cli.core.segments import SegmentModel
from monet_cli.core.solver.heuristics import level_plans
from monet_cli.profiler.run import profile_model
from tests.schedules_for_tests import plan_schedule

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def llama_profile():
    from bench.real_models import case_spec

    return profile_model(case_spec("llama"), torch.device("cpu"), steps=1)


def _finest_schedule(profile, path: Path) -> None:
    """Every segment of the finest module level where ops can be kept, each keeping its first
    candidate op (so the selective policy runs too)."""
    model = SegmentModel(profile)
    levels = sorted(level_plans(model).values(), key=len, reverse=True)
    plan = next(p for p in levels if any(model.segments[c].candidates for c in p))
    plan = {c: frozenset(model.segments[c].candidates[:1]) for c in plan}
    save_schedule(
        plan_schedule(profile, plan, model=model),
        path,
    )


def _torchrun(worker: str, schedule: Path, out: Path, **extra_env: str) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **extra_env)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(ROOT / "tests" / worker),
            str(schedule),
            str(out),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_ddp_two_processes_same_gradients(tmp_path: Path, resnet18_profile):
    _finest_schedule(resnet18_profile, tmp_path / "ddp.yaml")
    reports = _torchrun("ddp_worker.py", tmp_path / "ddp.yaml", tmp_path)
    assert all(r["world"] == 2 for r in reports)
    assert all(r["equal"] for r in reports), reports


def test_ddp_runs_a_chain_segment(tmp_path: Path, resnet18_profile):
    """ResNet's stem as one chain segment (its frame opens in conv1's forward and closes in
    maxpool's) beside a module segment, under DDP: gradients equal the unscheduled run's."""
    profile = resnet18_profile
    model = SegmentModel(profile)
    by_name = {seg.fqn: c for c, seg in model.segments.items()}
    plan = {by_name["conv1..maxpool"]: frozenset(), by_name["layer1"]: frozenset()}
    save_schedule(
        plan_schedule(profile, plan, model=model),
        tmp_path / "chain.yaml",
    )
    reports = _torchrun("ddp_worker.py", tmp_path / "chain.yaml", tmp_path)
    assert all(r["equal"] for r in reports), reports


def test_ddp_runs_op_ranges(tmp_path: Path, resnet18_profile):
    """Two op ranges under DDP, one of the model's own forward (bn1 to the end of layer1) and one
    of a block's (bn2 to the residual add and the last ReLU): gradients equal the unscheduled run's."""
    profile = resnet18_profile
    model = SegmentModel(profile)
    calls = {c.fqn: c for c in profile.calls}
    by_name = {seg.fqn: c for c, seg in model.segments.items()}
    plan = {
        by_name[f"<model>[{calls['bn1'].first_op}:{calls['layer1'].end_op}]"]: frozenset(),
        by_name[f"layer2.0[{calls['layer2.0.bn2'].first_op}:{calls['layer2.0'].end_op}]"]: frozenset(),
    }
    save_schedule(
        plan_schedule(profile, plan, model=model),
        tmp_path / "ranges.yaml",
    )
    reports = _torchrun("ddp_worker.py", tmp_path / "ranges.yaml", tmp_path)
    assert all(r["equal"] for r in reports), reports


@pytest.mark.slow
def test_fsdp2_runs_op_ranges_in_sharded_layers(tmp_path: Path, llama_profile):
    """In each LLaMA decoder layer (an FSDP2 unit), the op range with the most of the layer's own
    code: its replay calls the layer's projections while FSDP2 has their parameters gathered."""
    profile = llama_profile
    model = SegmentModel(profile)
    best: dict[int, int] = {}
    for c, r in model.ranges.items():
        if c in model.segments and re.fullmatch(r"model\.layers\.\d+", profile.calls[r.parent].fqn):
            if r.parent not in best or r.own_ops > model.ranges[best[r.parent]].own_ops:
                best[r.parent] = c
    assert len(best) >= 2
    save_schedule(
        plan_schedule(profile, dict.fromkeys(best.values(), frozenset()), model=model),
        tmp_path / "fsdp.yaml",
    )
    reports = _torchrun("fsdp_worker.py", tmp_path / "fsdp.yaml", tmp_path)
    for r in reports:
        assert r["scheduled"] == r["plain"] and r["params_equal"], r


def test_ddp_runs_an_offload_beside_a_segment(tmp_path: Path, monkeypatch):
    """layer1's saved tensors offloaded (numpy arrays standing in for pinned memory) beside
    layer3 checkpointed, under DDP: gradients equal the unscheduled run's."""
    import monet_cli.core.offload as core_offload
    from monet_cli.core.profile import Transfer

    monkeypatch.setattr(core_offload, "MIN_OFFLOAD_BYTES", 1)  # resnet18 at 32 px moves well under 1 MiB
    profile = profile_model(small_spec("resnet18", shape=(3, 32, 32), batch_size=2), torch.device("cpu"), steps=1)
    profile = replace(profile, transfer=Transfer(fixed_ms=0.01, to_host_bytes_per_ms=25e6, to_device_bytes_per_ms=25e6))
    model = SegmentModel(profile)
    layer3 = next(c for c, seg in model.segments.items() if seg.fqn == "layer3")
    layer1 = next(i for i, v in enumerate(model.profile.variants) if v.impl == "offload" and v.module == "layer1")
    schedule = plan_schedule(profile, {layer3: frozenset()}, model=model, variants=frozenset({layer1}))
    assert [o.module for o in schedule.offloads] == ["layer1"]
    save_schedule(schedule, tmp_path / "offload.yaml")
    reports = _torchrun("ddp_worker.py", tmp_path / "offload.yaml", tmp_path, MONET_TEST_HOST_ARRAYS="1")
    assert all(r["equal"] for r in reports), reports


@pytest.mark.slow
def test_fsdp2_three_steps_match_unscheduled(tmp_path: Path, llama_profile):
    """monet.apply before fully_shard: the fingerprint check sees through FSDP2's hooks (and still
    refuses another batch size), and training matches the unscheduled FSDP2 run bit for bit."""
    _finest_schedule(llama_profile, tmp_path / "fsdp.yaml")
    reports = _torchrun("fsdp_worker.py", tmp_path / "fsdp.yaml", tmp_path)
    assert all(r["world"] == 2 for r in reports)
    assert reports[0]["plain"] != reports[1]["plain"], "each rank should see its own rows"
    for r in reports:
        assert r["scheduled"] == r["plain"], r
        assert r["params_equal"], r
        assert r["refused_other_batch"], r
