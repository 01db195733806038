"""Config errors for what a model's family cannot do: one line naming the key, before anything launches."""

from __future__ import annotations

import logging
from typing import Any, Optional

from easytrain.config.errors import ConfigError
from easytrain.config.schema import Config
from easytrain.models.families import ADAPTERS, Family, family_of

logger = logging.getLogger(__name__)


def _asked(config: Config) -> list[tuple[str, str, Any]]:
    """(feature, config key, value) for every family-dependent feature the config turns on."""
    w, d = config.worker, config.data
    asked: list[tuple[str, str, Any]] = []
    if d.video_key and d.image_key:
        asked.append(("video", "data.video_key", d.video_key))
    for role in ("actor", "ref"):
        size = getattr(w, role).ulysses_size
        if size > 1:
            asked.append(("ulysses", f"worker.{role}.ulysses_size", size))
    if w.rollout.engine == "vllm":
        asked.append(("vllm", "worker.rollout.engine", "vllm"))
    if w.actor.padding_free:
        asked.append(("padding_free", "worker.actor.padding_free", True))
    if w.rollout.multi_turn.enable and d.image_key:
        asked.append(("multi_turn_images", "worker.rollout.multi_turn.enable", True))
    return asked


def serving(feature: str) -> str:
    """The families whose adapters serve ``feature``, for an error's fix."""
    return ", ".join(cls.label for cls in ADAPTERS if feature in cls.features)


def check_family(config: Config, hf_config: Optional[dict[str, Any]]) -> Optional[Family]:
    """The adapter of the configured model (None when its config cannot be known offline); a ConfigError for a
    feature the config turns on that the family cannot serve, or images a family without an image layout gets
    (the generic adapter: a config without transformers' common fixed-size image interface, see
    :meth:`Family.fixed_image`)."""
    if hf_config is None:
        return None
    family = family_of(hf_config)
    for feature, key, value in _asked(config):
        reason = family.unsupported(feature)
        if reason is not None:
            raise ConfigError(key, value, reason, f"turn it off, or use a model of a family that supports it "
                                                  f"({serving(feature)})")
    if family.vision and config.data.image_key and family.layout() is None:
        with_images = ", ".join(cls.label for cls in ADAPTERS if cls.tiny_tokens and cls.processor_class_path)
        raise ConfigError("data.image_key", config.data.image_key,
                          f"easytrain has no image adapter for model_type={family.model_type}, and its config "
                          "states no fixed image size, token count and image token for the generic adapter's image "
                          "path (it trains the model's text only)", f"set data.image_key=null, or use a model of a family with one "
                          f"({with_images})")
    for feature, key in (("image_dedup", "model.dedupe_images"), ("shared_prompt", "worker.actor.share_prompt")):
        if family.unsupported(feature) and _on(config, key):
            logger.info("%s: off for %s (%s)", key, family.model_type, family.unsupported(feature))
    return family


def _on(config: Config, key: str) -> bool:
    node: Any = config
    for part in key.split("."):
        node = getattr(node, part)
    return bool(node)
