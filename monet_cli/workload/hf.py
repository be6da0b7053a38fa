"""Hugging Face transformers models built from a config alone: nothing is downloaded.

``hf:TARGET``, where TARGET is

- a transformers model class: ``hf:BertForSequenceClassification``;
- a model type: ``hf:llama``, ``hf:gpt2``, ``hf:t5`` (the language-model head that type has:
  sequence-to-sequence, else masked, else causal, else the bare model);
- a ``config.json`` file as ``save_pretrained`` writes it (its ``architectures`` names the class).

``--model-arg KEY=VALUE`` sets config fields (``hidden_size=256``). The model is trained
the way people train it: it gets ``input_ids``, an all-ones ``attention_mask`` and
``labels`` for its head, and returns its own loss.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

from monet_cli.core.profile import InputSpec
from monet_cli.errors import UsageError

DEFAULT_SEQ_LEN = 128

# Class-name endings -> the labels that head computes its loss from (per sample).
_TOKEN_LABELS = ("ForCausalLM", "LMHeadModel", "ForMaskedLM", "ForConditionalGeneration", "ForTokenClassification")
_CLASS_LABELS = ("ForSequenceClassification", "ForImageClassification")
# Model-type lookup order: the first auto mapping that knows the type gives the class.
_HEAD_MAPPINGS = (
    "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_MAPPING_NAMES",
)


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise UsageError("hf: models need transformers: pip install 'monet-cli[hf]'") from None
    return transformers


def resolve_hf_target(target: str, kwargs: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """``hf:`` target -> (model class name, config fields): a config file is read here so
    the spec (and every schedule made from it) carries the whole config, not a path.
    ``kwargs`` (what the user typed) must name fields the config has."""
    model_class, fields = _class_and_fields(target, kwargs)
    _refuse_unknown_fields(_model_class(model_class).config_class, kwargs)
    return model_class, fields


def _class_and_fields(target: str, kwargs: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    if target.endswith(".json"):
        path = Path(target)
        try:
            data = json.loads(path.read_text())
        except OSError as err:
            raise UsageError(f"hf:{target}: cannot read the config: {err.strerror}") from None
        except json.JSONDecodeError as err:
            raise UsageError(f"hf:{target}: not valid JSON: {err}") from None
        if not isinstance(data, dict) or "model_type" not in data:
            raise UsageError(f"hf:{target}: a transformers config.json needs a model_type")
        architectures = data.pop("architectures", None) or []
        fields = {k: v for k, v in data.items() if not k.startswith("_") and k != "transformers_version"}
        model_class = architectures[0] if architectures else _class_for_type(fields["model_type"])
        return model_class, {**fields, **kwargs}
    if target[:1].isupper():
        _model_class(target)  # fail early on a typo
        return target, dict(kwargs)
    return _class_for_type(target), {"model_type": target, **kwargs}


def _class_for_type(model_type: str) -> str:
    transformers = _transformers()
    from transformers.models.auto import modeling_auto

    for mapping in _HEAD_MAPPINGS:
        name = getattr(modeling_auto, mapping).get(model_type)
        if name is not None and hasattr(transformers, name):
            return name
    known = sorted(modeling_auto.MODEL_MAPPING_NAMES)
    import difflib

    close = difflib.get_close_matches(model_type, known, n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise UsageError(f"hf:{model_type}: not a transformers model type or model class{hint}")


def _model_class(name: str) -> Any:
    transformers = _transformers()
    cls = getattr(transformers, name, None)
    if not (inspect.isclass(cls) and issubclass(cls, transformers.PreTrainedModel)):
        raise UsageError(f"hf:{name}: transformers has no model class of that name")
    return cls


def hf_config(model_class: str, fields: dict[str, Any]) -> Any:
    cls = _model_class(model_class)
    fields = {k: v for k, v in fields.items() if k != "model_type"}
    try:
        config = cls.config_class(**fields)
    except Exception as err:  # transformers validates configs with its own exception types
        raise UsageError(f"hf:{model_class}: bad config: {' '.join(str(err).split())[:300]}") from None
    if getattr(config, "is_encoder_decoder", False) and getattr(config, "decoder_start_token_id", None) is None:
        # Published T5 configs start decoding at the pad token; a bare config may not say so.
        config.decoder_start_token_id = config.pad_token_id
    return config


def _refuse_unknown_fields(config_class: Any, fields: dict[str, Any]) -> None:
    """transformers keeps any unknown keyword as an attribute: a typo would be silently ignored.
    (A config.json written by transformers may carry keys of other versions: those are not checked.)"""
    known = set(config_class().to_dict()) | set(getattr(config_class, "attribute_map", {}))
    known |= set(inspect.signature(config_class.__init__).parameters)
    unknown = sorted(k for k in fields if k not in known and not hasattr(config_class, k))  # e.g. num_labels
    if unknown:
        import difflib

        close = difflib.get_close_matches(unknown[0], sorted(known), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise UsageError(f"{config_class.__name__} has no field '{unknown[0]}'{hint}")


def build_hf_model(model_class: str, fields: dict[str, Any]) -> Any:
    return _model_class(model_class)(hf_config(model_class, fields))


def hf_inputs(model_class: str, fields: dict[str, Any], shape: tuple[int, ...] | None) -> tuple[InputSpec, ...]:
    """What the model's forward takes in training: its main input, a mask, its labels.

    ``shape`` is the sequence length (token models) or C,H,W (image models); None picks
    128 tokens or the config's image size.
    """
    cls = _model_class(model_class)
    config = hf_config(model_class, fields)
    params = inspect.signature(cls.forward).parameters
    main = getattr(cls, "main_input_name", "input_ids")
    if main == "input_ids":
        seq_len = _seq_len(config, shape)
        vocab = int(config.vocab_size)
        specs = [InputSpec(name="input_ids", shape=(seq_len,), dtype="int64", low=0, high=vocab)]
        if "attention_mask" in params:
            specs.append(InputSpec(name="attention_mask", shape=(seq_len,), dtype="int64", low=1, high=2))
        token_labels = InputSpec(name="labels", shape=(seq_len,), dtype="int64", low=0, high=vocab)
    elif main == "pixel_values":
        size = getattr(config, "image_size", None)
        if shape is None and not isinstance(size, int):
            raise UsageError(f"hf:{model_class}: its config has no image size: give --input-shape C,H,W")
        image = shape or (int(getattr(config, "num_channels", 3)), size, size)
        if len(image) != 3:
            raise UsageError(f"hf:{model_class}: --input-shape is C,H,W for image models, got {image}")
        specs = [InputSpec(name="pixel_values", shape=image)]
        token_labels = None
    else:
        raise UsageError(f"hf:{model_class}: monet builds inputs for input_ids and pixel_values models, not {main}")
    if "labels" in params:
        labels = _labels(model_class, config, token_labels)
        if labels is not None:
            specs.append(labels)
    return tuple(specs)


def _seq_len(config: Any, shape: tuple[int, ...] | None) -> int:
    if shape is not None and len(shape) != 1:
        raise UsageError(f"--input-shape for a token model is the sequence length (e.g. 128), got {shape}")
    seq_len = shape[0] if shape else DEFAULT_SEQ_LEN
    limit = next((getattr(config, k) for k in ("max_position_embeddings", "n_positions") if hasattr(config, k)), None)
    if isinstance(limit, int) and seq_len > limit:
        if shape:
            raise UsageError(f"sequence length {seq_len} is above the model's {limit} positions")
        seq_len = limit
    return seq_len


def _labels(model_class: str, config: Any, token_labels: InputSpec | None) -> InputSpec | None:
    if model_class.endswith(_CLASS_LABELS):
        if int(config.num_labels) == 1:  # one label is regression: float targets
            return InputSpec(name="labels", shape=())
        return InputSpec(name="labels", shape=(), dtype="int64", low=0, high=int(config.num_labels))
    if model_class.endswith(_TOKEN_LABELS) and token_labels is not None:
        if model_class.endswith("ForTokenClassification"):
            return InputSpec(name="labels", shape=token_labels.shape, dtype="int64", low=0, high=int(config.num_labels))
        return token_labels
    return None
