"""Random and mutated files never crash a loader: one FileFormatError line, or a valid object."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from monet_cli.core.codec import from_data, to_data
from monet_cli.core.plan import build_schedule
from monet_cli.core.profile import ModuleCall, load_profile, profile_from_data, save_profile
from monet_cli.core.schedule import SolverInfo, load_schedule, save_schedule, schedule_from_data
from monet_cli.core.segments import SegmentModel
from monet_cli.core.solver.heuristics import level_plans
from monet_cli.errors import FileFormatError

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)


@pytest.fixture(scope="module")
def files(tmp_path_factory, skip_cnn_profile):
    root = tmp_path_factory.mktemp("fuzz")
    model = SegmentModel(skip_cnn_profile)
    plan = next(iter(level_plans(model).values()))
    info = SolverInfo(
        method="test",
        status="OPTIMAL",
        objective=1.0,
        bound=1.0,
        gap=0.0,
        time_s=0.1,
        workers=1,
        seed=0,
        time_limit_s=1.0,
        ortools="x",
    )
    schedule = build_schedule(
        skip_cnn_profile,
        plan,
        budget_bytes=skip_cnn_profile.baseline.peak_bytes * 2,
        budget_spec="200%",
        solver=info,
        profile_sha256="0" * 64,
        model=model,
    )
    save_profile(skip_cnn_profile, root / "p.yaml")
    save_schedule(schedule, root / "s.yaml")
    return root, to_data(skip_cnn_profile), to_data(schedule)


def _paths(data, prefix=()):
    """Every (path) to a value inside nested dicts/lists, to pick mutation targets from."""
    yield prefix
    if isinstance(data, dict):
        for key, value in data.items():
            yield from _paths(value, prefix + (key,))
    elif isinstance(data, list) and data:
        yield from _paths(data[0], prefix + (0,))


def _mutate(data, path, action, value):
    data = copy.deepcopy(data)
    if not path:
        return value
    parent = data
    for key in path[:-1]:
        parent = parent[key]
    last = path[-1]
    if action == "delete" and isinstance(parent, dict):
        del parent[last]
    elif action == "rename" and isinstance(parent, dict):
        parent[f"{last}_x"] = parent.pop(last)
    else:
        parent[last] = value
    return data


def _loads_cleanly(loader, data) -> None:
    try:
        loader(data, source="fuzz.yaml")
    except FileFormatError as err:
        message = str(err)
        assert message.startswith("fuzz.yaml: ") and "\n" not in message


@pytest.mark.parametrize("which", ["profile", "schedule"])
@SETTINGS
@given(data=st.data())
def test_mutated_files(files, which, data):
    _, profile_data, schedule_data = files
    original, loader = (profile_data, profile_from_data) if which == "profile" else (schedule_data, schedule_from_data)
    path = data.draw(st.sampled_from(list(_paths(original))))
    action = data.draw(st.sampled_from(["delete", "rename", "replace"]))
    mutated = _mutate(original, path, action, data.draw(SCALARS))
    if isinstance(mutated, dict):
        _loads_cleanly(loader, mutated)


@SETTINGS
@given(cut=st.integers(min_value=0, max_value=4000), noise=st.binary(max_size=30))
def test_truncated_and_corrupted_files(files, tmp_path_factory, cut, noise):
    root, _, _ = files
    for name, loader in (("p.yaml", load_profile), ("s.yaml", load_schedule)):
        text = (root / name).read_bytes()
        broken = root / f"broken-{name}"
        broken.write_bytes(text[:cut] + noise)
        try:
            loader(broken)
        except FileFormatError as err:
            assert str(err).startswith(str(broken)) and "\n" not in str(err)


def test_each_rejection_names_file_and_key(files):
    root, profile_data, schedule_data = files
    cases = [
        (profile_from_data, {**profile_data, "schema_version": 2}, "schema_version: 2 is not supported"),
        (profile_from_data, {**profile_data, "kind": "monet.schedule"}, "this is a monet.schedule file"),
        (schedule_from_data, {**schedule_data, "kind": "monet.profile"}, "this is a monet.profile file"),
        (profile_from_data, {**profile_data, "surprise": 1}, "surprise: unknown key"),
        (
            profile_from_data,
            {**profile_data, "baseline": {**profile_data["baseline"], "peak_bytes": -5}},
            "baseline.peak_bytes: must not be negative",
        ),
        (schedule_from_data, {**schedule_data, "budget_bytes": "8G"}, "budget_bytes: expected int"),
        (
            schedule_from_data,
            {**schedule_data, "predicted": {**schedule_data["predicted"], "peak_bytes": 1}},
            "content_sha256",
        ),
    ]
    for loader, data, needle in cases:
        with pytest.raises(FileFormatError, match=needle) as info:
            loader(data, source="f.yaml")
        assert str(info.value).startswith("f.yaml: ")


def test_yaml_that_is_not_a_mapping(tmp_path: Path):
    path = tmp_path / "list.yaml"
    path.write_text(yaml.safe_dump([1, 2, 3]))
    with pytest.raises(FileFormatError, match="expected a YAML mapping"):
        load_profile(path)


def test_an_unknown_key_with_a_newline_is_named_on_one_line():
    """Found by ``test_mutated_files``: a key from the file went into the message as it was."""
    with pytest.raises(FileFormatError) as raised:
        from_data(ModuleCall, {"\n": 0}, source="fuzz.yaml")
    assert str(raised.value) == "fuzz.yaml: '\\n': unknown key (written by a newer monet?)"
