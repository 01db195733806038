"""Model shapes known without downloading weights.

Validation (and later the memory planner) needs the attention-head layout
and sizes of a model before anything is loaded. They come from, in order: the
tiny-model specs, ``conf/model/`` for ``random:<name>`` (the named file's
shape: the planner prices it exactly as the checkpoint it copies), a local
folder's ``config.json``, or ``conf/model/`` by hub id (the shape settings of
public checkpoints' published ``config.json``, one file each, checked against
their published parameter counts in the tests; :mod:`easytrain.config.presets`
reads that folder).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Optional

from easytrain.config.presets import RANDOM_PREFIX, known_hf_configs, random_hf_config
from easytrain.config.errors import ConfigError
from easytrain.config.schema import ModelConfig
from easytrain.config.validate import ModelShape

logger = logging.getLogger(__name__)

def shape_from_hf_config(hf: dict[str, Any]) -> ModelShape:
    """Read a ModelShape from a ``config.json`` dict (flat or with ``text_config``)."""
    family = str(hf.get("model_type", "unknown"))
    text = dict(hf)
    text.update(hf.get("text_config") or {})  # transformers 5 nests the LM settings
    heads = int(text["num_attention_heads"])
    return ModelShape(
        family=family,
        num_attention_heads=heads,
        num_key_value_heads=int(text.get("num_key_value_heads") or heads),
        hidden_size=int(text["hidden_size"]),
        num_hidden_layers=int(text["num_hidden_layers"]),
        vocab_size=int(text["vocab_size"]),
        max_position_embeddings=int(text.get("max_position_embeddings") or 32768),
        is_vision="vision_config" in hf,
    )


def tiny_config(model: ModelConfig) -> dict[str, Any]:
    """The HF config of ``model.path=tiny:<family>``; a ConfigError for a family without a tiny model."""
    from easytrain.models.tiny import FAMILIES, tiny_hf_config

    family = model.path[len("tiny:"):]
    if family not in FAMILIES:
        raise ConfigError("model.path", model.path, "unknown tiny model family",
                          "use " + ", ".join(f"tiny:{name}" for name in FAMILIES))
    return tiny_hf_config(family, model.tiny_size)


def resolve_shape(model: ModelConfig) -> Optional[ModelShape]:
    """The shape of ``model.path``, or None when it cannot be known offline."""
    path = model.path
    if path.startswith("tiny:"):
        return shape_from_hf_config(tiny_config(model))
    if path.startswith(RANDOM_PREFIX):
        return shape_from_hf_config(random_hf_config(path))
    config_file = Path(path).expanduser() / "config.json"
    if config_file.is_file():
        return shape_from_hf_config(json.loads(config_file.read_text()))
    known = known_hf_configs().get(path)
    if known is not None:
        return shape_from_hf_config(known)
    logger.warning("model.path=%s: shape unknown offline; head-dependent checks run when the model loads", path)
    return None


def hf_config_for(model: ModelConfig) -> Optional[dict[str, Any]]:
    """The HF config dict of ``model.path`` without downloading: tiny specs, ``conf/model/<name>`` for
    random:<name>, a local folder's config.json, or ``conf/model/`` by hub id; None when unknown offline."""
    path = model.path
    if path.startswith("tiny:"):
        return tiny_config(model)
    if path.startswith(RANDOM_PREFIX):
        return random_hf_config(path)
    config_file = Path(path).expanduser() / "config.json"
    if config_file.is_file():
        return dict(json.loads(config_file.read_text()))
    return known_hf_configs().get(path)
