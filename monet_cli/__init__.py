"""monet: plan and apply activation checkpointing so PyTorch training fits a memory budget."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
