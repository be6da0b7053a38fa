"""The ways a user could train a workload, each ready to step: baseline, PyTorch's own
checkpointing, torch.compile's memory budget, and monet schedules."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from monet_cli.core.profile import ModelSpec
from monet_cli.core.schedule import Schedule
from monet_cli.runtime.executor import apply_schedule
from monet_cli.workload.step import Workload, build_workload


@dataclass
class Method:
    name: str
    kind: str
    """baseline, pytorch, compile or monet."""
    workload: Workload
    meter: str = "live-storages"
    info: dict[str, Any] = field(default_factory=dict)


def blocks_of(model: nn.Module, block_types: tuple[str, ...]) -> list[tuple[str, nn.Module]]:
    """Residual blocks / transformer layers / U-Net stages with their paths, in forward order."""
    return [(fqn, m) for fqn, m in model.named_modules() if type(m).__name__ in block_types]


def _checkpoint_forward(module: nn.Module) -> None:
    original = module.forward

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        # What torchtitan calls full activation checkpointing: non-reentrant, RNG preserved.
        return checkpoint(original, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)

    module.forward = forward


def baseline(spec: ModelSpec, device: torch.device) -> Method:
    return Method(name="no checkpointing", kind="baseline", workload=build_workload(spec, device, prepare=False))


def checkpoint_every(spec: ModelSpec, device: torch.device, block_types: tuple[str, ...], k: int) -> Method:
    """``torch.utils.checkpoint`` around every k-th block (k=1: every block)."""
    workload = build_workload(spec, device, prepare=False)
    blocks = blocks_of(workload.model, block_types)
    if not blocks:
        raise ValueError(f"no blocks of type {block_types} in {spec.name}")
    chosen = [(fqn, block) for index, (fqn, block) in enumerate(blocks) if index % k == 0]
    for _, block in chosen:
        _checkpoint_forward(block)
    name = "ckpt every block" if k == 1 else f"ckpt every {_ordinal(k)} block"
    return Method(
        name=name,
        kind="pytorch",
        workload=workload,
        info={"blocks": len(blocks), "k": k, "checkpointed": [fqn for fqn, _ in chosen]},
    )


def monet(spec: ModelSpec, device: torch.device, schedule: Schedule, info: dict[str, Any]) -> Method:
    workload = build_workload(spec, device)
    apply_schedule(workload.model, schedule)
    return Method(name=f"monet {schedule.budget_spec}", kind="monet", workload=workload, info=info)


class CompiledStep:
    """torch.compile (aot_eager) with the partitioner's activation_memory_budget."""

    def __init__(self, workload: Workload, budget: float) -> None:
        self.workload = workload
        self.budget = budget
        self.compiled = torch.compile(workload.model, backend="aot_eager")

    def step(self, on_phase: Callable[[str, torch.Tensor], None] | None = None) -> None:
        """``Workload.step`` with the compiled model (``on_phase`` as there)."""
        import torch._functorch.config as functorch_config

        with functorch_config.patch(activation_memory_budget=self.budget):
            output = self.workload.run_model(self.compiled)
            loss = self.workload.loss_fn(output)
            if on_phase:
                on_phase("backward", loss)
            loss.backward()
            if on_phase:
                on_phase("optimizer", loss)
            if self.workload.optimizer is not None:
                self.workload.optimizer.step()


def compiled(spec: ModelSpec, device: torch.device, budget: float) -> Method:
    """A compiled workload. Dynamo caches graphs per code object, not per budget, so
    callers must ``torch._dynamo.reset()`` before using another budget and must not
    interleave compiled methods."""
    torch._dynamo.reset()
    workload = build_workload(spec, device, prepare=False)
    runner = CompiledStep(workload, budget)
    workload.step = runner.step  # type: ignore[method-assign]
    return Method(
        name=f"compile budget {budget}",
        kind="compile",
        workload=workload,
        meter="profiler-counter",
        info={"activation_memory_budget": budget},
    )


def profiler_peak(step: Callable[[], None], workload: Workload) -> int:
    """Peak of the profiler's allocator counter over one step ("Total Allocated").

    The only meter that sees compiled code; it includes kernel temporaries, so it reads a
    little above the live-storage meter. ``bench`` reports compile points on this scale
    shifted by (eager live-storage peak - eager profiler peak), measured in the same run.
    """
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    workload.zero_grad()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if workload.device.type == "cuda" else [])
    with profile(activities=activities, profile_memory=True) as prof:
        step()
    with tempfile.NamedTemporaryFile(suffix=".json") as handle:
        prof.export_chrome_trace(handle.name)
        trace = json.load(open(handle.name))
    totals = [
        int(event["args"]["Total Allocated"])
        for event in trace.get("traceEvents", [])
        if event.get("name") == "[memory]" and "Total Allocated" in event.get("args", {})
    ]
    return max(totals, default=0)


def _ordinal(k: int) -> str:
    return {2: "2nd", 3: "3rd"}.get(k, f"{k}th")
