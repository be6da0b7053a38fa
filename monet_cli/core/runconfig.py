"""Run configs (``configs/<name>.yaml``): a model plus the training step to profile it with."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from monet_cli.core.codec import from_data
from monet_cli.core.profile import InputSpec, Precision
from monet_cli.core.yamlio import load_yaml_file

RUN_CONFIG_KIND = "monet.run"


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    kind: Literal["monet.run"] = RUN_CONFIG_KIND
    model: str
    """A torchvision model name, ``hf:NAME``, ``timm:NAME`` or an import path ``package.module:function``."""
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    batch_size: int | None = None
    inputs: tuple[InputSpec, ...] | None = None
    optimizer: Literal["sgd", "adamw", "none"] | None = None
    lr: float | None = None
    loss: str | None = None
    """``auto``, ``cross_entropy``, ``token_cross_entropy``, ``mean_square`` or ``package.module:function``."""
    seed: int | None = None
    precision: Precision | None = None
    description: str = ""


def load_run_config(path: Path) -> RunConfig:
    path = Path(path)
    return from_data(RunConfig, load_yaml_file(path), source=str(path))


def find_run_config(name: str, configs_dir: Path = Path("configs")) -> Path | None:
    """``name`` as a YAML path, or ``configs/<name>.yaml``; None when it is neither."""
    candidate = Path(name)
    if candidate.suffix in (".yaml", ".yml"):
        return candidate
    named = configs_dir / f"{name}.yaml"
    return named if named.is_file() else None
