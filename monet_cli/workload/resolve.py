"""Resolve what the user typed as MODEL into a ``ModelSpec`` and build the model.

Order: a run config (``configs/<MODEL>.yaml`` or a YAML path), a torchvision model
name, an import path ``package.module:function`` returning an ``nn.Module``.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from monet_cli.core.profile import InputSpec, ModelSpec, OptimizerSpec
from monet_cli.core.runconfig import RunConfig, find_run_config, load_run_config
from monet_cli.errors import ModelError, UsageError

DEFAULT_IMAGE_SHAPE = (3, 224, 224)


@dataclass(frozen=True, kw_only=True, slots=True)
class Overrides:
    """Command-line options; None means "not given" so run-config values stay."""

    batch_size: int | None = None
    inputs: tuple[InputSpec, ...] | None = None
    optimizer: str | None = None
    lr: float | None = None
    loss: str | None = None
    seed: int | None = None
    model_kwargs: dict[str, Any] | None = None
    precision: str | None = None


def torchvision_names() -> list[str]:
    import torchvision

    return sorted(torchvision.models.list_models(module=torchvision.models))


def resolve_model_spec(model_arg: str, overrides: Overrides, *, configs_dir: Path = Path("configs")) -> ModelSpec:
    config_path = find_run_config(model_arg, configs_dir)
    if config_path is not None:
        if not config_path.is_file():
            raise UsageError(f"run config {config_path} does not exist")
        config = load_run_config(config_path)
        name = config_path.stem
    else:
        config = RunConfig(model=model_arg)
        name = _name_of(model_arg)
    return _spec_from(model_arg, name, config, overrides)


def _name_of(target: str) -> str:
    if target.endswith(".json"):
        return Path(target).stem
    return target.rsplit(":", 1)[-1] if ":" in target else target


def _spec_from(model_arg: str, name: str, config: RunConfig, overrides: Overrides) -> ModelSpec:
    source, target = _classify_target(config.model)
    kwargs = {**config.model_kwargs, **(overrides.model_kwargs or {})}
    if source == "hf":
        from monet_cli.workload.hf import resolve_hf_target

        target, kwargs = resolve_hf_target(target, kwargs)
    inputs = _inputs(source, target, kwargs, overrides.inputs or config.inputs)
    if source in ("torchvision", "timm"):
        kwargs = _fit_image_size(source, target, kwargs, inputs)
    batch_size = overrides.batch_size or config.batch_size or 8
    if batch_size <= 0:
        raise UsageError(f"--batch-size must be positive, got {batch_size}")
    optimizer = OptimizerSpec(
        name=overrides.optimizer or config.optimizer or "sgd",  # type: ignore[arg-type]
        lr=overrides.lr if overrides.lr is not None else (config.lr if config.lr is not None else 0.01),
    )
    return ModelSpec(
        spec=model_arg,
        name=name,
        source=source,
        target=target,
        kwargs=kwargs,
        batch_size=batch_size,
        inputs=tuple(inputs),
        optimizer=optimizer,
        loss=overrides.loss or config.loss or "auto",
        seed=overrides.seed if overrides.seed is not None else (config.seed or 0),
        precision=overrides.precision or config.precision or "32",
    )


def _inputs(
    source: str, target: str, kwargs: dict[str, Any], given: tuple[InputSpec, ...] | None
) -> tuple[InputSpec, ...]:
    """The inputs as given, or the ones the model's source implies."""
    if source == "hf" and not (given and all(spec.name for spec in given)):
        from monet_cli.workload.hf import hf_inputs

        return hf_inputs(target, kwargs, _hf_shape(given))
    if given is not None:
        return tuple(given)
    if source in ("torchvision", "timm"):
        return (InputSpec(shape=DEFAULT_IMAGE_SHAPE),)
    raise UsageError(f"model '{target}': give the per-sample input shape with --input-shape (e.g. 3,32,32)")


def _hf_shape(given: tuple[InputSpec, ...] | None) -> tuple[int, ...] | None:
    """For hf: models --input-shape is the sequence length (or C,H,W); inputs are built from the model."""
    if not given:
        return None
    if len(given) != 1 or given[0].dtype != "float32" or given[0].low is not None:
        raise UsageError(
            "hf: models take one --input-shape (the sequence length, or C,H,W for images); "
            "monet builds input_ids, attention_mask and labels itself, so --input-dtype and "
            "--input-range do not apply"
        )
    return given[0].shape


def _classify_target(target: str) -> tuple[str, str]:
    for prefix in ("hf", "timm"):
        if target.startswith(f"{prefix}:"):
            name = target[len(prefix) + 1 :]
            if not name:
                raise UsageError(
                    f"'{target}': name a model after '{prefix}:', e.g. {prefix}:"
                    + ("llama" if prefix == "hf" else "convnext_atto")
                )
            if prefix == "timm":
                _check_timm_name(name)
            return prefix, name
    if ":" in target:
        module, _, attr = target.partition(":")
        if not module or not attr:
            raise UsageError(f"import path '{target}' must look like package.module:function")
        return "import", target
    names = torchvision_names()
    if target in names:
        return "torchvision", target
    close = difflib.get_close_matches(target, names, n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise UsageError(
        f"unknown model '{target}': not a run config in configs/, a torchvision model, hf:NAME, timm:NAME or "
        f"an import path package.module:function{hint}"
    )


def _timm() -> Any:
    try:
        import timm
    except ImportError:
        raise UsageError("timm: models need timm: pip install 'monet-cli[timm]'") from None
    return timm


def _check_timm_name(name: str) -> None:
    timm = _timm()
    if not timm.is_model(name):
        close = difflib.get_close_matches(name, timm.list_models(), n=3, cutoff=0.6)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise UsageError(f"timm:{name}: timm has no model of that name{hint}")


def _fit_image_size(source: str, name: str, kwargs: dict[str, Any], inputs: tuple[InputSpec, ...]) -> dict[str, Any]:
    """ViTs bake the image size into their position embeddings: follow --input-shape."""
    shape = inputs[0].shape
    if "image_size" in kwargs or "img_size" in kwargs or len(shape) != 3 or shape[1] == DEFAULT_IMAGE_SHAPE[1]:
        return kwargs
    if source == "timm":
        return {**kwargs, "img_size": shape[1]} if _timm_takes_img_size(name, shape[1]) else kwargs
    import torchvision

    builder = torchvision.models.get_model_builder(name)
    if "image_size" in inspect.signature(builder).parameters or name.startswith("vit_"):
        return {**kwargs, "image_size": shape[1]}
    return kwargs


def _timm_takes_img_size(name: str, size: int) -> bool:
    """Whether the timm model has an ``img_size`` argument (built on the meta device: no memory)."""
    try:
        with torch.device("meta"):
            _timm().create_model(name, pretrained=False, img_size=size)
    except TypeError:
        return False
    return True


def build_model(spec: ModelSpec) -> nn.Module:
    """Construct the model with a fixed seed so every build has the same weights."""
    torch.manual_seed(spec.seed)
    factory = _factory(spec)
    try:
        model = factory(**spec.kwargs)
    except TypeError as err:
        raise UsageError(f"model '{spec.target}' does not accept these arguments: {_one_line(err)}") from None
    except Exception as err:  # the user's code: show its own error in one line
        raise ModelError(f"building model '{spec.target}' failed: {type(err).__name__}: {_one_line(err)}") from None
    if not isinstance(model, nn.Module):
        raise UsageError(f"'{spec.target}' returned {type(model).__name__}, expected a torch.nn.Module")
    return model


def _factory(spec: ModelSpec) -> Any:
    if spec.source == "torchvision":
        import torchvision

        return lambda **kw: torchvision.models.get_model(spec.target, weights=None, **kw)
    if spec.source == "timm":
        return lambda **kw: _timm().create_model(spec.target, pretrained=False, **kw)
    if spec.source == "hf":
        from monet_cli.workload.hf import build_hf_model

        return lambda **kw: build_hf_model(spec.target, kw)
    module_name, _, attr = spec.target.partition(":")
    # Like uvicorn or ``python -m``: the user's own package in the working directory imports.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise UsageError(f"cannot import '{module_name}' (from '{spec.target}'): {_one_line(err)}") from None
    except Exception as err:
        raise ModelError(f"importing '{module_name}' failed: {type(err).__name__}: {_one_line(err)}") from None
    factory = module
    for part in attr.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            raise UsageError(f"module '{module_name}' has no attribute '{attr}'")
    if not callable(factory):
        raise UsageError(f"'{spec.target}' is not callable; it must be a function or class returning an nn.Module")
    return factory


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def parse_input_shape(text: str) -> tuple[int, ...]:
    """``3,128,128`` (or ``3x128x128``) -> (3, 128, 128)."""
    parts = [p.strip() for p in text.replace("x", ",").split(",")]
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        raise UsageError(f"input shape '{text}': expected integers like 3,128,128") from None
    if not shape or any(d <= 0 for d in shape):
        raise UsageError(f"input shape '{text}': every dimension must be a positive integer")
    return shape


def parse_input_range(text: str) -> tuple[int, int]:
    """``0:1000`` -> (0, 1000): integer inputs drawn from [low, high)."""
    low, sep, high = text.partition(":")
    try:
        bounds = (int(low), int(high))
    except ValueError:
        raise UsageError(f"input range '{text}': expected LOW:HIGH integers like 0:50257") from None
    if not sep or bounds[0] >= bounds[1]:
        raise UsageError(f"input range '{text}': LOW must be below HIGH")
    return bounds
