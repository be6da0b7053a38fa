"""Training loops as users write them, around a scheduled model: what the prediction covers
(the output a loop holds) and what a scheduled model refuses (a second forward before a
backward). The hooks a loop registers: ``test_rehearse.py``."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch

from monet_cli.core.profile import InputSpec, ModelSpec
from monet_cli.core.schedule import Schedule
from monet_cli.core.segments import SegmentModel
from monet_cli.errors import FingerprintError
from monet_cli.profiler.run import profile_model
from monet_cli.runtime import guards
from monet_cli.runtime.executor import apply_schedule
from monet_cli.runtime.meter import measure_step
from monet_cli.workload.resolve import Overrides, resolve_model_spec
from monet_cli.workload.step import Workload, build_workload
from tests.schedules_for_tests import plan_schedule

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def scheduled() -> tuple[Callable[[], Workload], Schedule]:
    """A three-block model (batch 128) with its first block checkpointed: a fresh scheduled
    workload per call, and the schedule."""
    spec = resolve_model_spec(
        "tests.models_for_tests:hooked_net",
        Overrides(batch_size=128, inputs=(InputSpec(shape=(16,)),), model_kwargs={"store": None, "num_classes": 64}),
    )
    profile = profile_model(spec, CPU, steps=1)
    block = next(c.index for c in profile.calls if c.fqn == "blocks.0")
    schedule = plan_schedule(profile, {block: frozenset()})
    return functools.partial(_scheduled, spec, schedule), schedule


def _scheduled(spec: ModelSpec, schedule: Schedule) -> Workload:
    """A fresh workload of ``spec`` with ``schedule`` applied."""
    workload = build_workload(spec, CPU)
    apply_schedule(workload.model, schedule)
    return workload


def _holding_loop(workload: Workload, held: list, **kwargs: Any) -> Callable[[], None]:
    """A step as ``outputs = model(x, **kwargs)`` writes it: the output held in ``held``
    through backward and the optimizer step, until the next forward returns."""

    def step() -> None:
        args, _ = workload.call_args()
        held[:] = [workload.model(*args, **kwargs)]  # the previous output dies once the forward returns
        workload.loss_fn(held[0]).backward()
        workload.optimizer.step()

    return step


def _peak(workload: Workload, step: Callable[[], None], held: list[torch.Tensor]) -> int:
    """The second of two steps, measured with what the loop held from the first."""
    step()
    workload.zero_grad()
    # Generators: a list here would hold the first step's output through the second.
    preexisting = itertools.chain(workload.resident_tensors(), ((t, "output") for t in held))
    return measure_step(step, device=CPU, preexisting=preexisting).peak_bytes


def test_a_loop_holding_its_output_peaks_at_the_prediction(scheduled):
    """``outputs = model(x)`` holds the output through backward and the optimizer step, and
    into the next step until its forward returns: the profile measures its step that way."""
    build, schedule = scheduled
    workload = build()
    held: list[torch.Tensor] = []
    assert _peak(workload, _holding_loop(workload, held), held) == schedule.predicted.peak_bytes


def test_a_second_training_forward_before_the_first_s_backward_is_refused(scheduled, monkeypatch):
    """Two training forwards and then one backward (two views of a batch, a discriminator on
    real and fake samples) hold both forwards' saved tensors, where the profile measured one:
    unchecked, the step measures over its prediction. A scheduled model refuses the second
    forward; a forward whose output is dropped, and a backward after each forward, pass."""
    build, schedule = scheduled

    def two_forwards(workload: Workload) -> Callable[[], None]:
        def step() -> None:
            args, _ = workload.call_args()
            first, second = workload.model(*args), workload.model(*args)
            (workload.loss_fn(first) + workload.loss_fn(second)).backward()
            workload.optimizer.step()

        return step

    with monkeypatch.context() as unchecked:
        unchecked.setattr(guards._LoopGuard, "install", lambda *_: [])
        workload = build()
        assert _peak(workload, two_forwards(workload), []) > schedule.predicted.peak_bytes
    refused = build()
    with pytest.raises(FingerprintError, match="a training forward started while the previous one's graph still"):
        two_forwards(refused)()
    passing = build()
    args, _ = passing.call_args()
    passing.model(*args)  # dropped unused: its graph is freed
    for _ in range(2):  # gradient accumulation
        passing.loss_fn(passing.model(*args)).backward()


def test_a_forward_returning_more_than_the_profiled_output_is_refused():
    """Asked for its hidden states, the model returns every block's output with its logits; a
    loop holding the output keeps what a range over the blocks drops and recomputes, and the
    step measures over its prediction. A scheduled model refuses that forward; called as it was
    profiled, it holds the prediction."""
    spec = resolve_model_spec(
        "tests.models_for_tests:hidden_states_net",
        Overrides(batch_size=128, inputs=(InputSpec(shape=(16,)),), model_kwargs={"num_classes": 64}),
    )
    profile = profile_model(spec, CPU, steps=1)
    model = SegmentModel(profile)
    blocks = next(c for c, r in model.ranges.items() if r.parent == 0 and len(r.calls) == 3)
    schedule = plan_schedule(profile, {blocks: frozenset()}, model=model)
    assert schedule.fingerprint.output_bytes == 128 * 64 * 4  # the logits
    build = functools.partial(_scheduled, spec, schedule)
    with pytest.MonkeyPatch.context() as unchecked:
        unchecked.setattr("monet_cli.runtime.executor.install_output_check", lambda *_: [])
        workload, held = build(), []
        assert (
            _peak(workload, _holding_loop(workload, held, output_hidden_states=True), held)
            > schedule.predicted.peak_bytes
        )
    workload, held = build(), []
    logits_and_hidden = f"{128 * 64 * 4 + 3 * 128 * 16 * 4:,}"
    with pytest.raises(FingerprintError, match=f"its output holds {logits_and_hidden} bytes of tensors where the"):
        _holding_loop(workload, held, output_hidden_states=True)()
    workload, held = build(), []
    assert _peak(workload, _holding_loop(workload, held), held) == schedule.predicted.peak_bytes
