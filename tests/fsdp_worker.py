"""Run by tests/test_distributed.py under torchrun: three FSDP2 steps with and without a schedule.

The schedule is applied before ``fully_shard`` (each block of every ModuleList, then the
root), as documented, with the fingerprint check on. Each rank feeds its own rows. Rank
results go to OUT/rank<N>.json: per-step losses of both runs, whether the full parameters
are equal after the last step, and whether a wrong-batch model is still refused.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import monet_cli
from monet_cli.core.schedule import load_schedule
from monet_cli.errors import FingerprintError
from monet_cli.workload.step import build_workload

STEPS = 3


def shard(model: torch.nn.Module) -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for module in list(model.modules()):
        if isinstance(module, torch.nn.ModuleList):
            for block in module:
                fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def train(schedule_path: Path, scheduled: bool, rank: int, batch_size: int | None = None):
    spec = load_schedule(schedule_path).model
    if batch_size is not None:
        from dataclasses import replace

        spec = replace(spec, batch_size=batch_size)
    workload = build_workload(spec, torch.device("cpu"), prepare=scheduled)
    if scheduled:
        monet_cli.apply(workload.model, schedule_path)
    shard(workload.model)
    optimizer = torch.optim.SGD(workload.model.parameters(), lr=0.01, momentum=0.9)
    workload.inputs = tuple(x.roll(rank, dims=0) for x in workload.inputs)  # each rank its own rows
    losses = []
    for step in range(STEPS):
        torch.manual_seed(100 + 10 * step + rank)
        optimizer.zero_grad(set_to_none=True)
        loss = workload.loss_fn(workload.run_model())
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    params = {n: p.full_tensor().detach().clone() for n, p in workload.model.named_parameters()}
    return losses, params


def main() -> None:
    schedule_path, out = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    plain_losses, plain_params = train(schedule_path, False, rank)
    losses, params = train(schedule_path, True, rank)
    equal = plain_params.keys() == params.keys() and all(torch.equal(plain_params[n], params[n]) for n in params)
    try:
        train(schedule_path, True, rank, batch_size=load_schedule(schedule_path).model.batch_size + 1)
        refused = False
    except FingerprintError:
        refused = True
    report = {
        "plain": plain_losses,
        "scheduled": losses,
        "params_equal": equal,
        "refused_other_batch": refused,
        "world": dist.get_world_size(),
    }
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
