from __future__ import annotations

import pytest
import torch

from monet_cli.core.profile import InputSpec
from monet_cli.profiler.run import profile_model
from monet_cli.workload.resolve import Overrides, resolve_model_spec


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _quick_pricing() -> dict[tuple[object, str], float]:
    """The profiler's timing effort for the suite's profiles: they test memory, structure and
    the pricing code's paths, and their tiny models' steps are noisy past any price's use.

    - ``in_step.NOISY_PRICES`` off: every tiny model's noise passed 3% of its step, so every
      profile ran a second batch of in-step rounds and warned (test_chains, test_rehearse and
      test_cli_profile 52 s against 34 to 38 s, 12-07).
    - Three pairs a measurement, one warm-up, 5 rounds of a probe and 3 to 5 of a call timed
      alone, where monet ships 10 a timed step, 2, 21 and 9 to 21: pricing took 46 and 17 of
      the 80 s profiling took in the two slowest tests (efficientnet_b0 and the LLaMA
      reproduction, 12-07).
    - A measurement in 2 s, not 8: three pairs would pair steps up to 800 ms, where monet
      pairs up to 276 ms and times longer steps' calls alone (the GPT-2 reproduction's 500 ms
      step paired for 23 s of its 39 s profile, against 6 s for its calls alone). Now up to
      200 ms.

    The suite took 537 s here against 1,010 s before (12-07 22:23 and 21:56, run alone)."""
    from monet_cli.profiler import alone, in_step, probe

    return {
        (in_step, "NOISY_PRICES"): float("inf"),
        (in_step, "PAIRS_PER_STEP"): 3,
        (in_step, "MIN_PAIRS"): 3,
        (in_step, "WARM_UP_PAIRS"): 1,
        (in_step, "BUDGET_S"): 2.0,
        (probe, "ROUNDS"): 5,
        (alone, "MIN_ROUNDS"): 3,
        (alone, "MAX_ROUNDS"): 5,
    }


@pytest.fixture(scope="session", autouse=True)
def quick_pricing():
    """Pins ``_quick_pricing`` for the session; yields what monet ships."""
    quick = _quick_pricing()
    shipped = {(module, name): getattr(module, name) for module, name in quick}
    for (module, name), value in quick.items():
        setattr(module, name, value)
    yield shipped
    for (module, name), value in shipped.items():
        setattr(module, name, value)


@pytest.fixture
def shipped_pricing(quick_pricing, monkeypatch):
    """The profiler's timing effort as monet ships it, for one test of that effort."""
    for (module, name), value in quick_pricing.items():
        monkeypatch.setattr(module, name, value)


def small_spec(model: str = "resnet18", shape=(3, 32, 32), batch_size: int = 2, **kwargs):
    return resolve_model_spec(model, Overrides(batch_size=batch_size, inputs=(InputSpec(shape=shape),), **kwargs))


@pytest.fixture(scope="session")
def resnet18_profile():
    return profile_model(small_spec(), torch.device("cpu"), steps=1)


@pytest.fixture(scope="session")
def skip_cnn_profile():
    return profile_model(small_spec("tests.models_for_tests:skip_cnn"), torch.device("cpu"), steps=1)


@pytest.fixture
def no_lowering(monkeypatch):
    """The warm start's ``lower_peak`` adds nothing, so a test sees the solve's later fallbacks
    (on the small test profiles it reaches the smallest peak)."""
    from monet_cli.core.simulate import simulate
    from monet_cli.core.solver import search

    def unchanged(linear, plan, budget_bytes, *, deadline):
        return plan, simulate(linear.model.profile, plan, model=linear.model)

    monkeypatch.setattr(search, "lower_peak", unchanged)
