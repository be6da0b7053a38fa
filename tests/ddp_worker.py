"""Run by tests/test_ddp.py under torchrun: one step of DDP with and without a schedule.

Each rank feeds its own batch; after backward (gradients all-reduced) the scheduled and
unscheduled DDP models must hold the same gradients. Rank results go to OUT/rank<N>.json.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import monet_cli
from monet_cli.core.schedule import load_schedule
from monet_cli.workload.step import build_workload


def grads_after_step(schedule_path: Path | None, spec, rank: int) -> dict[str, torch.Tensor]:
    workload = build_workload(spec, torch.device("cpu"), prepare=schedule_path is not None)
    if schedule_path is not None:
        monet_cli.apply(workload.model, schedule_path)  # before wrapping, as documented
    model = DDP(workload.model)
    workload.inputs = tuple(x + rank for x in workload.inputs)  # each rank sees different data
    torch.manual_seed(100 + rank)
    output = workload.run_model(model)
    loss = workload.loss_fn(output)
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in workload.model.named_parameters()}


def main() -> None:
    schedule_path, out = Path(sys.argv[1]), Path(sys.argv[2])
    if os.environ.get("MONET_TEST_HOST_ARRAYS"):  # a schedule with offloads, run on this CPU
        from host_arrays import ArrayHost

        from monet_cli.runtime import offload

        offload.pinned_host_store = lambda: lambda device: ArrayHost()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    spec = load_schedule(schedule_path).model
    plain = grads_after_step(None, spec, rank)
    scheduled = grads_after_step(schedule_path, spec, rank)
    worst = max(float((plain[n] - scheduled[n]).abs().max()) for n in plain)
    equal = all(torch.allclose(plain[n], scheduled[n], rtol=1e-5, atol=1e-6) for n in plain)
    (out / f"rank{rank}.json").write_text(
        json.dumps({"equal": equal, "max_diff": worst, "world": dist.get_world_size()})
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
