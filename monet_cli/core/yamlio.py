"""YAML reading and writing: safe loaders only, stable key order, atomic writes."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import yaml

from monet_cli.errors import FileFormatError, OutputError, UsageError

# libyaml makes loading a large profile ~10x faster; fall back to pure Python when absent.
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_BaseDumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


class FlowMap(dict):
    """A mapping written on one line: keeps long per-op tables readable and small."""


class _Dumper(_BaseDumper):  # type: ignore[misc, valid-type]
    pass


def _represent_flow_map(dumper: yaml.SafeDumper, data: FlowMap) -> yaml.Node:
    return dumper.represent_mapping("tag:yaml.org,2002:map", data.items(), flow_style=True)


def _represent_tuple(dumper: yaml.SafeDumper, data: tuple) -> yaml.Node:
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=True)


_Dumper.add_representer(FlowMap, _represent_flow_map)
_Dumper.add_representer(tuple, _represent_tuple)


def dump_yaml(data: dict[str, Any]) -> str:
    """Serialise plain data; key order is the insertion order (never sorted)."""
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120)


def load_yaml_file(path: Path) -> dict[str, Any]:
    """Read a YAML mapping, turning every failure into one line that names the file."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"{path}: file not found") from None  # a typo, not a corrupt file
    except (OSError, UnicodeDecodeError) as err:
        raise FileFormatError(f"{path}: cannot read: {err}") from None
    try:
        data = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        problem = getattr(err, "problem", None) or "invalid YAML"
        raise FileFormatError(f"{path}: not valid YAML{where}: {problem}") from None
    if not isinstance(data, dict):
        raise FileFormatError(f"{path}: expected a YAML mapping at the top level")
    return data


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so readers never see a half-written file.

    The text goes to a temporary file in the same directory, is flushed to disk, then
    renamed over the target: an interrupted run leaves any older file intact.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as err:
        raise OutputError(f"{path}: cannot write: {err.strerror or err}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp_name, _file_mode(path))  # mkstemp makes 0600; give the mode a plain open() would
        os.replace(tmp_name, path)
    except BaseException as err:
        Path(tmp_name).unlink(missing_ok=True)
        if isinstance(err, OSError):
            raise OutputError(f"{path}: cannot write: {err.strerror or err}") from None
        raise


def _file_mode(path: Path) -> int:
    if path.exists():
        return path.stat().st_mode & 0o777
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def check_writable(path: Path) -> None:
    """Fail early (before minutes of profiling) when the output cannot be created."""
    path = Path(path)
    if path.is_dir():
        raise OutputError(f"{path}: is a directory, expected a file path")
    parent = path.parent
    probe = parent
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise OutputError(f"{path}: cannot write: directory {probe} is not writable")
    if path.exists() and not os.access(path, os.W_OK):
        raise OutputError(f"{path}: cannot write: file is read-only")
