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


@pytest.fixture(scope="session", autouse=True)
def quiet_enough_prices():
    """The tests' profiles price checkpointing from one batch of in-step rounds. Their tiny
    models' steps are noisy far past ``NOISY_PRICES`` of a 3 ms step, so every profile ran a
    second batch and warned: 52 s against 34 to 38 s for test_chains, test_rehearse and
    test_cli_profile (12-07). Tests of the second batch and its warning take the real
    threshold back (``noisy_prices_threshold``). Yields the real one."""
    from monet_cli.profiler import in_step

    real = in_step.NOISY_PRICES
    in_step.NOISY_PRICES = float("inf")
    yield real
    in_step.NOISY_PRICES = real


@pytest.fixture
def noisy_prices_threshold(quiet_enough_prices, monkeypatch):
    """``NOISY_PRICES`` as monet ships it, for one test."""
    from monet_cli.profiler import in_step

    monkeypatch.setattr(in_step, "NOISY_PRICES", quiet_enough_prices)


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
