"""monet inside the loops people train with: Hugging Face's Trainer, gradient accumulation,
and a clear refusal when the model already checkpoints itself."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import monet_cli
from bench.real_models import CPU, case_spec
from monet_cli.core.plan import build_schedule
from monet_cli.core.schedule import Schedule
from monet_cli.core.segments import SegmentModel
from monet_cli.core.solver.search import Planner, solver_info
from monet_cli.errors import CheckpointConflictError
from monet_cli.profiler.run import profile_model
from monet_cli.workload.resolve import build_model
from monet_cli.workload.step import build_workload

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gpt2_schedule() -> Schedule:
    """hf:gpt2 (dropout 0.1), solved halfway between its baseline and its smallest peak."""
    spec = case_spec("gpt2")
    profile = profile_model(spec, CPU, steps=1)
    model = SegmentModel(profile)
    planner = Planner(model)
    floor = planner.minimum_peak(time_limit_s=5, workers=1, seed=0).peak_bytes
    budget = (profile.baseline.peak_bytes + floor) // 2
    outcome = planner.solve(budget, time_limit_s=5, workers=1, seed=0)
    assert outcome.plan, "the schedule should checkpoint something"
    return build_schedule(
        profile,
        outcome.plan,
        budget_bytes=budget,
        budget_spec="halfway",
        profile_sha256="",
        model=model,
        solver=solver_info(outcome, workers=1, seed=0, time_limit_s=5),
    )


def _scheduled_model(schedule: Schedule) -> torch.nn.Module:
    model = build_model(schedule.model)
    with pytest.warns(UserWarning, match="use_cache = False"):
        monet_cli.apply(model, schedule)
    return model


def _trainer_run(model: torch.nn.Module, schedule: Schedule, out: Path) -> tuple[list[float], dict]:
    from transformers import Trainer, TrainingArguments

    spec = schedule.model
    workload = build_workload(spec, CPU)
    _, batch = workload.call_args()
    rows = [{name: tensor[i] for name, tensor in batch.items()} for i in range(spec.batch_size)] * 2
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=2,
        per_device_train_batch_size=spec.batch_size,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=rows)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_trainer_two_steps_match_the_unmodified_model(gpt2_schedule, tmp_path):
    plain_losses, plain_params = _trainer_run(build_model(gpt2_schedule.model), gpt2_schedule, tmp_path / "a")
    losses, params = _trainer_run(_scheduled_model(gpt2_schedule), gpt2_schedule, tmp_path / "b")
    assert len(losses) == 2
    assert losses == plain_losses
    assert all(torch.equal(params[n], plain_params[n]) for n in plain_params)


def test_trainer_with_gradient_checkpointing_is_refused(gpt2_schedule, tmp_path):
    from transformers import Trainer, TrainingArguments

    model = _scheduled_model(gpt2_schedule)
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=1,
        per_device_train_batch_size=4,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        gradient_checkpointing=True,
        disable_tqdm=True,
    )
    workload = build_workload(gpt2_schedule.model, CPU)
    _, batch = workload.call_args()
    rows = [{name: tensor[i] for name, tensor in batch.items()} for i in range(4)]
    with pytest.raises(CheckpointConflictError, match="gradient_checkpointing_disable"):
        Trainer(model=model, args=args, train_dataset=rows).train()


def _accumulated_grads(model: torch.nn.Module, schedule: Schedule, micro_batches: int) -> dict[str, torch.Tensor]:
    workload = build_workload(schedule.model, CPU)
    _, batch = workload.call_args()
    model.train()
    model.zero_grad(set_to_none=True)
    for i in range(micro_batches):
        torch.manual_seed(10 + i)
        micro = {name: tensor.roll(i, dims=0) for name, tensor in batch.items()}  # another sample order each time
        (model(**micro).loss / micro_batches).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def test_gradient_accumulation_matches_the_unmodified_model(gpt2_schedule):
    plain = _accumulated_grads(build_model(gpt2_schedule.model), gpt2_schedule, 3)
    scheduled = _accumulated_grads(_scheduled_model(gpt2_schedule), gpt2_schedule, 3)
    assert plain.keys() == scheduled.keys()
    assert all(torch.equal(plain[n], scheduled[n]) for n in plain)


def test_model_that_already_checkpoints_is_refused(gpt2_schedule):
    model = build_model(gpt2_schedule.model)
    model.gradient_checkpointing_enable()
    with pytest.raises(CheckpointConflictError, match="gradient_checkpointing_disable"):
        monet_cli.apply(model, gpt2_schedule)


def test_checkpointing_switched_on_after_apply_is_refused_at_the_next_forward(gpt2_schedule):
    model = _scheduled_model(gpt2_schedule)
    model.gradient_checkpointing_enable()
    _, batch = build_workload(gpt2_schedule.model, CPU).call_args()
    with pytest.raises(CheckpointConflictError):
        model(**batch)


def test_torch_checkpoint_wrapper_is_refused(gpt2_schedule):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    model = build_model(gpt2_schedule.model)
    apply_activation_checkpointing(model, check_fn=lambda m: m is model.transformer.h[0])
    with pytest.raises(CheckpointConflictError, match="'transformer.h.0' is wrapped by torch's checkpoint_wrapper"):
        monet_cli.apply(model, gpt2_schedule)


def test_the_checkpointing_found_is_named_by_its_path_past_empty_child_slots():
    from monet_cli.runtime.guards import existing_checkpointing

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.ReLU()))
    model.register_module("absent", None)
    assert existing_checkpointing(model) is None
    model[1][0].grad_checkpointing = True
    assert existing_checkpointing(model).startswith("'1.0' has timm gradient checkpointing on")
    model.grad_checkpointing = True
    assert existing_checkpointing(model).startswith("the model has timm")


def test_timm_grad_checkpointing_is_refused():
    from monet_cli.runtime.guards import refuse_existing_checkpointing

    model = build_model(case_spec("vit_small"))
    refuse_existing_checkpointing(model)  # off: nothing to refuse
    model.set_grad_checkpointing(True)
    with pytest.raises(CheckpointConflictError, match="set_grad_checkpointing"):
        refuse_existing_checkpointing(model)
