"""Turn frozen dataclasses into plain YAML data and back, checking every key and type.

Loading is strict (like accelerate's config loader): a missing key, an unknown key or a
wrong type is one ``FileFormatError`` line naming the file and the dotted key path.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

from monet_cli.core.yamlio import FlowMap
from monet_cli.errors import FileFormatError

T = TypeVar("T")

# Dataclasses whose instances are written as one-line mappings (rows of long tables).
FLOW_CLASSES: set[type] = set()


def flow_row(cls: type[T]) -> type[T]:
    """Class decorator: write instances of ``cls`` on one YAML line."""
    FLOW_CLASSES.add(cls)
    return cls


def to_data(value: Any, *, omit_defaults: frozenset[str] = frozenset()) -> Any:
    """Dataclass tree -> dicts/lists/scalars in field order.

    ``omit_defaults`` names fields (``Class.field``) left out while they hold their default.
    """
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        mapping = FlowMap() if type(value) in FLOW_CLASSES else {}
        for field in dataclasses.fields(value):
            item = getattr(value, field.name)
            if f"{type(value).__name__}.{field.name}" in omit_defaults and item == field.default:
                continue
            mapping[field.name] = to_data(item, omit_defaults=omit_defaults)
        return mapping
    if isinstance(value, tuple) and all(isinstance(v, (int, float, str, bool)) for v in value):
        return tuple(v if not isinstance(v, str) else str(v) for v in value)  # scalar tuples stay inline
    if isinstance(value, (list, tuple)):
        return [to_data(v, omit_defaults=omit_defaults) for v in value]
    if isinstance(value, str):
        return str(value)  # plain str: subclasses such as TorchVersion cannot be dumped
    if isinstance(value, dict):
        return {str(k): to_data(v, omit_defaults=omit_defaults) for k, v in value.items()}
    return value


class _Reader:
    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, path: str, message: str) -> FileFormatError:
        return FileFormatError(f"{self.source}: {path or '<top>'}: {message}")

    def read(self, tp: Any, data: Any, path: str) -> Any:
        origin = get_origin(tp)
        if tp is Any:
            return data
        if origin in (Union, types.UnionType):
            return self._read_union(tp, data, path)
        if dataclasses.is_dataclass(tp):
            return self._read_dataclass(tp, data, path)
        if origin is tuple:
            return self._read_tuple(tp, data, path)
        if origin is dict:
            return self._read_dict(tp, data, path)
        if origin is typing.Literal:
            if data not in get_args(tp):
                choices = ", ".join(repr(c) for c in get_args(tp))
                raise self.fail(path, f"expected one of {choices}, got {data!r}")
            return data
        return self._read_scalar(tp, data, path)

    def _read_union(self, tp: Any, data: Any, path: str) -> Any:
        options = get_args(tp)
        if data is None:
            if type(None) in options:
                return None
            raise self.fail(path, "must not be empty")
        tagged = self._tagged_option(options, data, path)
        if tagged is not None:
            return self.read(tagged, data, path)
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return self.read(option, data, path)
            except FileFormatError as err:
                errors.append(err)
        raise errors[0]

    def _tagged_option(self, options: tuple, data: Any, path: str) -> Any:
        """For a union of dataclasses told apart by a ``kind`` literal: the one ``data`` names."""
        kinds = {}
        for option in options:
            hint = get_type_hints(option).get("kind") if dataclasses.is_dataclass(option) else None
            if get_origin(hint) is not typing.Literal:
                return None
            kinds.update(dict.fromkeys(get_args(hint), option))
        if not isinstance(data, dict) or "kind" not in data:
            return None
        kind = data["kind"]
        if not isinstance(kind, str) or kind not in kinds:
            known = ", ".join(map(str, kinds))
            raise self.fail(
                _join(path, "kind"), f"unknown kind {_short(kind)} (known: {known}; written by a newer monet?)"
            )
        return kinds[kind]

    def _read_scalar(self, tp: Any, data: Any, path: str) -> Any:
        name = getattr(tp, "__name__", str(tp))
        if tp is float and isinstance(data, int) and not isinstance(data, bool):
            return float(data)  # YAML writes 2.0 as 2.0, but hand edits may say 2
        if tp is int and isinstance(data, bool):
            raise self.fail(path, f"expected int, got bool {data!r}")
        if tp in (int, float, str, bool) and not isinstance(data, tp):
            raise self.fail(path, f"expected {name}, got {type(data).__name__} {_short(data)}")
        if tp is int and path.endswith("_bytes") and data < 0:
            raise self.fail(path, f"must not be negative, got {data}")
        return data

    def _read_tuple(self, tp: Any, data: Any, path: str) -> tuple:
        if not isinstance(data, (list, tuple)):
            raise self.fail(path, f"expected a list, got {type(data).__name__}")
        args = get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(self.read(args[0], item, f"{path}[{i}]") for i, item in enumerate(data))
        if len(args) != len(data):
            raise self.fail(path, f"expected {len(args)} items, got {len(data)}")
        return tuple(self.read(a, item, f"{path}[{i}]") for i, (a, item) in enumerate(zip(args, data)))

    def _read_dict(self, tp: Any, data: Any, path: str) -> dict:
        if not isinstance(data, dict):
            raise self.fail(path, f"expected a mapping, got {type(data).__name__}")
        key_tp, value_tp = get_args(tp)
        return {self.read(key_tp, k, f"{path}.<key>"): self.read(value_tp, v, f"{path}.{k}") for k, v in data.items()}

    def _read_dataclass(self, cls: Any, data: Any, path: str) -> Any:
        if not isinstance(data, dict):
            raise self.fail(path, f"expected a mapping, got {type(data).__name__} {_short(data)}")
        hints = get_type_hints(cls)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = [k for k in data if k not in fields]
        if unknown:
            key = str(unknown[0])
            # The key comes from the file: a newline in it would break the error's one line.
            raise self.fail(
                _join(path, key if key.isprintable() else _short(key)), "unknown key (written by a newer monet?)"
            )
        values = {}
        for name, field in fields.items():
            sub = _join(path, name)
            if name not in data:
                if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
                    raise self.fail(sub, "missing key")
                continue
            values[name] = self.read(hints[name], data[name], sub)
        try:
            return cls(**values)
        except ValueError as err:  # __post_init__ consistency checks
            raise self.fail(path, str(err)) from None


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _short(data: Any) -> str:
    text = repr(data)
    return text if len(text) <= 40 else text[:37] + "..."


def from_data(cls: type[T], data: Any, *, source: str) -> T:
    """Build ``cls`` from loaded YAML data or raise one ``FileFormatError`` line."""
    return _Reader(source).read(cls, data, "")
