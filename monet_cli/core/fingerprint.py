"""Fingerprints bind a profile or schedule to one model structure and input shape."""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from monet_cli.core.profile import LOSS_MODULE

T = TypeVar("T")


def _digest(lines: Iterable[str]) -> str:
    sha = hashlib.sha256()
    for line in lines:
        sha.update(line.encode("utf-8"))
        sha.update(b"\n")
    return sha.hexdigest()[:16]


def structure_hash(ops: Iterable[tuple[str, str]]) -> str:
    """Hash of (aten overload, module path) per forward op: the same for any batch size."""
    return _digest(f"{op}|{module}" for op, module in ops)


def modules_hash(modules: Iterable[tuple[str, str, str]]) -> str:
    """Hash of (module path, class name, its own parameter and buffer shapes) per module: the
    model's structure as any device sees it, so a CPU runner can check a GPU's schedule."""
    return _digest(f"{path}|{kind}|{tensors}" for path, kind, tensors in modules)


def shapes_hash(signatures: Iterable[str]) -> str:
    """Hash of the tensor argument shapes and dtypes per forward op: changes with the batch."""
    return _digest(signatures)


def model_ops(ops: Sequence[T], module_of: Callable[[T], str]) -> list[T]:
    """The forward ops a fingerprint covers: the model's computation without its loss.

    A loss computed outside the model (monet's own, module ``<loss>``) is left out, and so
    are the ops the model itself runs after its last submodule returns: a head's loss from
    ``labels``, which training loops call differently (Hugging Face's Trainer passes
    ``num_items_in_batch``, a plain loop does not). Segments never contain those ops.
    """
    inside = [op for op in ops if module_of(op) != LOSS_MODULE]
    last = max((i for i, op in enumerate(inside) if module_of(op)), default=None)
    return inside if last is None else inside[: last + 1]


EVERY_MODULE = "*"
"""The path of a global hook (``torch.nn.modules.module.register_module_forward_hook``)."""


def hook_line(path: str, kind: str, function: str) -> str:
    """One hook as a fingerprint lists it: ``path|kind|function``."""
    return f"{path}|{kind}|{function}"


def unprofiled_hooks(profiled: Iterable[str], found: Iterable[str]) -> list[str]:
    """The hooks in ``found`` that ``profiled`` lacks, as many times as they are extra."""
    return sorted((Counter(found) - Counter(profiled)).elements())
