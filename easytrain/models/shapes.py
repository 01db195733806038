"""Model shapes known without downloading weights.

Validation (and later the memory planner) needs the attention-head layout
and sizes of a model before anything is loaded. They come from, in order: the
tiny-model specs, ``conf/model/`` for ``random:<name>`` (the named file's
shape: the planner prices it exactly as the checkpoint it copies), a local
folder's ``config.json``, or ``conf/model/`` by hub id (the shape settings of
public checkpoints' published ``config.json``, one file each, checked against
their published parameter counts in the tests).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Optional

from easytrain.config.schema import ModelConfig
from easytrain.config.validate import ConfigError, ModelShape

logger = logging.getLogger(__name__)

VISION_FAMILIES = ("qwen2_5_vl", "qwen2_vl")
RANDOM_PREFIX = "random:"
"""``model.path=random:<name>``: the shape of ``conf/model/<name>.yaml`` with random weights (models/random_init.py)."""

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
        is_vision="vision_config" in hf or family in VISION_FAMILIES,
    )


def resolve_shape(model: ModelConfig) -> Optional[ModelShape]:
    """The shape of ``model.path``, or None when it cannot be known offline."""
    path = model.path
    if path.startswith("tiny:"):
        from easytrain.models.tiny import tiny_hf_config

        return shape_from_hf_config(tiny_hf_config(path[5:], model.tiny_size))
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


MODEL_CONF_DIR = Path(__file__).resolve().parents[2] / "conf" / "model"
"""Full HF configs (shape settings) of public checkpoints, one YAML file each, keyed by ``hub_id``."""


def model_presets() -> dict[str, dict[str, Any]]:
    """``conf/model/`` file stem -> its entry (``hub_id`` and ``hf_config``)."""
    import yaml

    return {path.stem: yaml.safe_load(path.read_text()) for path in sorted(MODEL_CONF_DIR.glob("*.yaml"))}


def known_hf_configs() -> dict[str, dict[str, Any]]:
    """hub id -> the shape settings of its public ``config.json`` (from ``conf/model/``)."""
    return {entry["hub_id"]: entry["hf_config"] for entry in model_presets().values()}


def random_hf_config(path: str) -> dict[str, Any]:
    """The shape settings ``model.path=random:<name>`` builds: ``conf/model/<name>.yaml``'s ``hf_config``; an
    unknown name is a config error naming ``model.path`` and the valid names."""
    presets = model_presets()
    name = path[len(RANDOM_PREFIX):]
    if name not in presets:
        raise ConfigError("model.path", path, "unknown random: model (the names are conf/model/'s files)",
                          "use one of " + ", ".join(RANDOM_PREFIX + known for known in presets))
    return dict(presets[name]["hf_config"])


def hf_config_for(model: ModelConfig) -> Optional[dict[str, Any]]:
    """The HF config dict of ``model.path`` without downloading: tiny specs, ``conf/model/<name>`` for
    random:<name>, a local folder's config.json, or ``conf/model/`` by hub id; None when unknown offline."""
    path = model.path
    if path.startswith("tiny:"):
        from easytrain.models.tiny import tiny_hf_config

        return tiny_hf_config(path[5:], model.tiny_size)
    if path.startswith(RANDOM_PREFIX):
        return random_hf_config(path)
    config_file = Path(path).expanduser() / "config.json"
    if config_file.is_file():
        return dict(json.loads(config_file.read_text()))
    return known_hf_configs().get(path)
