"""Fingerprints bind a profile or schedule to one model structure and input shape."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable


def _digest(lines: Iterable[str]) -> str:
    sha = hashlib.sha256()
    for line in lines:
        sha.update(line.encode("utf-8"))
        sha.update(b"\n")
    return sha.hexdigest()[:16]


def structure_hash(ops: Iterable[tuple[str, str]]) -> str:
    """Hash of (aten overload, module path) per forward op: the same for any batch size."""
    return _digest(f"{op}|{module}" for op, module in ops)


def shapes_hash(signatures: Iterable[str]) -> str:
    """Hash of the tensor argument shapes and dtypes per forward op: changes with the batch."""
    return _digest(signatures)
