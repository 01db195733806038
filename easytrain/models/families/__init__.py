"""One adapter per model family (see :mod:`easytrain.models.families.base`).

``family_of(config)`` answers for a model's HF config (a ``config.json`` dict,
a transformers config or a loaded model); a ``model_type`` without an adapter
of its own gets the generic one (its text, and images where its config
follows transformers' common fixed-size interface, as LLaVA-1.5's does), with
the features that need family knowledge off. Adding a family is a module here, its line in
:data:`ADAPTERS`, its ``conf/model/`` presets and its docs.
"""

from __future__ import annotations

import json
import weakref
from pathlib import Path
from typing import Any, Mapping, Union

from torch import nn

from easytrain.models.families.base import FEATURES, Family, TinySpec
from easytrain.models.families.gemma3 import Gemma3
from easytrain.models.families.internvl import InternVL
from easytrain.models.families.qwen import Qwen2, Qwen2VL, Qwen3VL, Qwen3VLMoe, Qwen25VL, Qwen35

ADAPTERS: tuple[type[Family], ...] = (Qwen25VL, Qwen2VL, Qwen3VL, Qwen3VLMoe, Qwen35, InternVL, Gemma3, Qwen2)
"""Every family with an adapter of its own, the default model's first."""
BY_TYPE: dict[str, type[Family]] = {t: cls for cls in ADAPTERS for t in cls.model_types}
TINY_FAMILIES: tuple[str, ...] = tuple(t for cls in ADAPTERS if cls.tiny_tokens for t in cls.model_types)
"""The names ``tiny:<name>`` builds (each family's HF ``model_type``)."""

__all__ = ["ADAPTERS", "BY_TYPE", "FEATURES", "Family", "TINY_FAMILIES", "TinySpec", "adapter_class", "family_of",
           "family_of_folder"]


def adapter_class(model_type: str) -> type[Family]:
    """The adapter class of ``model_type`` (the generic :class:`Family` when it has none of its own)."""
    return BY_TYPE.get(model_type, Family)


def family_of(config: Union[Mapping[str, Any], Any]) -> Family:
    """The adapter of a model: ``config`` is a ``config.json`` dict, a transformers config, or a model (whose
    adapter is made once and kept on it)."""
    if isinstance(config, Mapping):
        if "model_type" not in config:
            raise ValueError("a model config without model_type: its architecture, and so its family, is unknown")
        return adapter_class(str(config["model_type"]))(config)
    if isinstance(config, nn.Module):
        family = _OF_MODEL.get(config)
        if family is None:
            wrapped = getattr(config, "module", None)
            if not hasattr(getattr(config, "config", None), "model_type") and isinstance(wrapped, nn.Module):
                return family_of(wrapped)  # a wrapper whose own config is not the model's (DeepSpeed's engine)
            family = _OF_MODEL[config] = family_of(config.config)
        return family
    return adapter_class(str(getattr(config, "model_type", "")))(config.to_dict())


_OF_MODEL: "weakref.WeakKeyDictionary[nn.Module, Family]" = weakref.WeakKeyDictionary()
"""The adapter of each live model, made once (a model's config does not change)."""


def family_of_folder(folder: Union[str, Path]) -> Family:
    """The adapter of a model folder (its ``config.json``) or hub id (through AutoConfig)."""
    config_file = Path(folder) / "config.json"
    if config_file.is_file():
        return family_of(json.loads(config_file.read_text()))
    from transformers import AutoConfig

    return family_of(AutoConfig.from_pretrained(str(folder)).to_dict())
