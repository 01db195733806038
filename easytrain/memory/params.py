"""Parameter counts by component, from a model's HF config alone.

The model is built from its transformers class on torch's meta device:
names and shapes are the real ones, nothing is allocated and no weights are
read, so a 72B model is counted in seconds on a laptop. Components are the
ones the planner prices separately: the vision tower, the projector (the
merger or multi-modal projector that maps vision features into the language
model, wherever the family's adapter places it: several mergers too), the token
embeddings, the language model's blocks and norms, and the LM head (zero
when tied to the embeddings: a tied weight is one tensor).

Mixture-of-experts language models (e.g. a 30B with 3B active) also report their
routed experts' weights and the share of them one token uses
(``num_experts_per_tok`` of ``num_experts``): ``ParamCounts.active`` is what
a token's forward multiplies, ``ParamCounts.total`` what the states hold.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from easytrain.models.families import ADAPTERS

COMPONENTS = ("vision_tower", "projector", "embeddings", "language_model", "lm_head")
PROJECTOR_PARTS = tuple(sorted({f".{path}." for cls in ADAPTERS for path in cls.projector_paths}))
"""Name parts of the projector, as the family adapters place it (``.visual.merger.``, ``.multi_modal_projector.``,
...)."""
VISION_PARTS = tuple(sorted({f".{cls.tower_path}." for cls in ADAPTERS if cls.tower_path}))
"""Name parts of the vision tower (what is not projector under them), as the family adapters place it."""


@dataclass(frozen=True)
class ParamCounts:
    vision_tower: int
    projector: int
    embeddings: int
    language_model: int
    lm_head: int
    experts: int = 0
    """Routed expert weights of a mixture-of-experts language model (part of ``language_model``)."""
    active_experts: int = 0
    """Of ``experts``, what one token uses: ``num_experts_per_tok / num_experts`` of them."""

    @property
    def total(self) -> int:
        return self.vision_tower + self.projector + self.embeddings + self.language_model + self.lm_head

    @property
    def active(self) -> int:
        """Parameters one token's forward uses: all but the experts it is not routed to (= total when dense)."""
        return self.total - self.experts + self.active_experts

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in COMPONENTS}


def component_of(name: str) -> str:
    """Which component a parameter name (HF naming, tower and projector paths as the family adapters give
    them) belongs to."""
    dotted = f".{name}"
    if any(part in dotted for part in PROJECTOR_PARTS):
        return "projector"
    if any(part in dotted for part in VISION_PARTS):
        return "vision_tower"
    if "embed_tokens" in name:
        return "embeddings"
    if name.startswith("lm_head"):
        return "lm_head"
    return "language_model"


def is_expert(name: str) -> bool:
    """Whether a parameter is a routed expert's weight (``mlp.experts.*``, fused or one module per expert)."""
    return ".experts." in f".{name}"


def experts_per_token(hf_config: dict[str, Any]) -> float:
    """The share of a mixture-of-experts model's routed experts one token uses (1.0 for a dense model)."""
    text = hf_config_object(hf_config).get_text_config()
    experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)
    chosen = getattr(text, "num_experts_per_tok", None)
    return chosen / experts if experts and chosen else 1.0


def hf_config_object(hf_config: dict[str, Any]) -> Any:
    """The transformers config a ``config.json`` dict describes: settings it leaves out take the model
    class's own defaults, i.e. what the model would really use."""
    from transformers import AutoConfig

    from easytrain.models.families.base import resolved_config

    settings = resolved_config(hf_config)
    return AutoConfig.for_model(settings.pop("model_type"), **settings)


def meta_model(hf_config: dict[str, Any]) -> Any:
    """The model ``hf_config`` describes, on the meta device: transformers' image-text-to-text class for a
    model with a vision tower, its causal-LM class otherwise (what ``from_pretrained`` builds for either)."""
    import torch
    import transformers

    config = hf_config_object(hf_config)
    vision = getattr(config, "vision_config", None) is not None
    auto = transformers.AutoModelForImageTextToText if vision else transformers.AutoModelForCausalLM
    with torch.device("meta"):
        return auto.from_config(config)


def count_parameters(hf_config: dict[str, Any]) -> ParamCounts:
    """Exact parameter counts of the model ``hf_config`` describes."""
    return _count_parameters(json.dumps(hf_config, sort_keys=True))


@lru_cache(maxsize=64)
def _count_parameters(key: str) -> ParamCounts:
    hf_config = json.loads(key)
    counts = dict.fromkeys(COMPONENTS, 0)
    experts = 0
    for name, parameter in meta_model(hf_config).named_parameters():  # a tied weight appears once
        counts[component_of(name)] += parameter.numel()
        experts += parameter.numel() if is_expert(name) else 0
    active = round(experts * experts_per_token(hf_config)) if experts else 0
    return ParamCounts(**counts, experts=experts, active_experts=active)


def largest_module(hf_config: dict[str, Any]) -> int:
    """Elements of the model's largest module (its parameters together: what one weight-sync bucket holds at
    least, since a module never splits)."""
    return _largest_module(json.dumps(hf_config, sort_keys=True))


@lru_cache(maxsize=64)
def _largest_module(key: str) -> int:
    sizes: dict[str, int] = {}
    for name, parameter in meta_model(json.loads(key)).named_parameters():
        module = name.rsplit(".", 1)[0]
        sizes[module] = sizes.get(module, 0) + parameter.numel()
    return max(sizes.values(), default=0)


def _actor_model(hf_config: dict[str, Any], model_cfg: Any) -> Any:
    """The meta model after the actor's own set-up: ``model.freeze_*`` and, with ``model.lora.rank > 0``,
    the LoRA adapters."""
    import torch

    from easytrain.models.parts import apply_lora, freeze_parts

    model = meta_model(hf_config)
    freeze_parts(model, model_cfg.freeze_vision_tower, model_cfg.freeze_aligner, model_cfg.freeze_llm)
    if model_cfg.lora.rank > 0:
        with torch.device("meta"):
            model = apply_lora(model, model_cfg.lora)
    return model


def trainable_parameters(hf_config: dict[str, Any], model_cfg: Any) -> tuple[int, int]:
    """(trainable, total) parameters of the actor's model (total includes LoRA adapters)."""
    parameters = list(_actor_model(hf_config, model_cfg).parameters())
    return sum(p.numel() for p in parameters if p.requires_grad), sum(p.numel() for p in parameters)


def trainable_by_component(hf_config: dict[str, Any], model_cfg: Any) -> dict[str, int]:
    """Trainable parameters of the actor's model per component (LoRA adapters count where they sit)."""
    return _trainable_by_component(json.dumps(hf_config, sort_keys=True), _model_key(model_cfg))


def largest_trainable(hf_config: dict[str, Any], model_cfg: Any) -> int:
    """Elements of the actor's largest trainable parameter (what one optimizer temporary holds)."""
    return _largest_trainable(json.dumps(hf_config, sort_keys=True), _model_key(model_cfg))


@lru_cache(maxsize=64)
def _largest_trainable(hf_key: str, model_key: tuple[Any, ...]) -> int:
    return max((p.numel() for p in _actor_from_key(hf_key, model_key).parameters() if p.requires_grad), default=0)


def _model_key(model_cfg: Any) -> tuple[Any, ...]:
    lora = model_cfg.lora
    return (model_cfg.freeze_vision_tower, model_cfg.freeze_aligner, model_cfg.freeze_llm, lora.rank,
            lora.alpha, tuple(lora.target_modules))


@lru_cache(maxsize=8)
def _actor_from_key(hf_key: str, model_key: tuple[Any, ...]) -> Any:
    from types import SimpleNamespace

    vision, aligner, llm, rank, alpha, targets = model_key
    model_cfg = SimpleNamespace(freeze_vision_tower=vision, freeze_aligner=aligner, freeze_llm=llm,
                                lora=SimpleNamespace(rank=rank, alpha=alpha, dropout=0.0, target_modules=list(targets)))
    return _actor_model(json.loads(hf_key), model_cfg)


@lru_cache(maxsize=64)
def _trainable_by_component(hf_key: str, model_key: tuple[Any, ...]) -> dict[str, int]:
    counts = dict.fromkeys(COMPONENTS, 0)
    for name, parameter in _actor_from_key(hf_key, model_key).named_parameters():
        if parameter.requires_grad:
            counts[component_of(name.removeprefix("base_model.model."))] += parameter.numel()
    return counts
