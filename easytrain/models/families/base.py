"""What easytrain needs to know about a model family, answered in one place.

A :class:`Family` is one architecture's adapter, made for one model's HF
config (``config.json`` as a dict). Everything that differs between families
is asked of it: the transformers class, the image processor, how the data
pipeline sizes images and expands their placeholders (:class:`Layout`), the
vision stream the collators build and how the model takes it, the position
ids (multimodal rotary or plain), where the vision tower, projector and
language model live (freezes, LoRA, FSDP, image dedup), and which of
easytrain's features serve the family. The trainer, workers, data pipeline
and planner hold an adapter and ask; family names appear only here and in
``conf/model/``.

This base class is the generic adapter: a text causal LM, or an image-text
model whose processor and forward follow transformers' common interface
(``pixel_values`` per image, one placeholder token per vision token, plain
positions). Features that need family knowledge are off for it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Optional, Sequence

import torch
from torch import nn

from easytrain.data.collate import text_positions
from easytrain.data.vision import Layout

logger = logging.getLogger(__name__)

FEATURES = ("video", "image_dedup", "shared_prompt", "padding_free", "ulysses", "vllm", "multi_turn_images",
            "kv_reuse")
"""easytrain features a family may or may not serve (the README's table lists them per family). ``kv_reuse``: the
HF engine's shared prefill and its decode loops, which copy and drop rows of the KV cache."""


@dataclass(frozen=True)
class TinySpec:
    """The shape of a tiny test model (models/tiny.py), which each family turns into its own config."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vision_depth: int
    vision_hidden: int
    vision_heads: int
    vision_intermediate: int
    vocab: int = 1024

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def resolved_config(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """``hf_config`` (a ``config.json`` dict) with the settings it leaves out at the transformers class's defaults,
    i.e. what the model really uses; as given for a ``model_type`` this transformers does not know."""
    from transformers import AutoConfig

    model_type = str(hf_config.get("model_type", ""))
    settings = {k: v for k, v in hf_config.items() if k != "model_type" and v is not None}  # unset ids
    try:
        return dict(AutoConfig.for_model(model_type, **settings).to_dict())
    except ValueError:  # an unknown model_type: only its own settings are known
        return {"model_type": model_type or "unknown", **settings}


def side(value: Any) -> int:
    """A size given as one number or an (height, width) pair."""
    return int(value[0] if isinstance(value, (list, tuple)) else value)


class Family:
    """The generic adapter (see the module docstring); families subclass it and override what differs."""

    model_types: ClassVar[tuple[str, ...]] = ()
    """HF ``model_type`` values this adapter serves."""
    label: ClassVar[str] = "any other transformers model (generic)"
    features: ClassVar[frozenset[str]] = frozenset()
    """Which of :data:`FEATURES` serve the family (the generic adapter: none of them)."""
    rope_rows: ClassVar[bool] = False
    """Positions are multimodal rotary rows (3, B, L) rather than (B, L)."""
    tower_path: ClassVar[str] = ""
    """Attribute path of the vision tower from the inner model (``model.model``), e.g. ``visual``."""
    projector_paths: ClassVar[tuple[str, ...]] = ()
    """Attribute paths of the projector's modules (vision features to the language model) from the inner model."""
    gated_vision_mlp: ClassVar[bool] = False
    """The planner's shape: the vision blocks' MLP is gated (SwiGLU)."""
    qk_norm: ClassVar[bool] = False
    """The planner's shape: attention normalises q and k per head."""
    sandwich_norm: ClassVar[bool] = False
    """The planner's shape: each attention / MLP output is normalised again before the residual add."""
    placeholder_names: ClassVar[tuple[str, ...]] = ("image_token_id", "video_token_id", "vision_start_token_id",
                                                     "vision_end_token_id")
    """Config attributes holding the ids of vision placeholder tokens, which a response may never contain."""
    channels_key: ClassVar[str] = "num_channels"
    """The vision config's key for its input channels."""
    tiny_tokens: ClassVar[tuple[str, ...]] = ()
    """Special tokens of the family's tiny tokenizer (eos ``<|im_end|>`` and pad ``<|endoftext|>`` among them);
    empty: no tiny model of this family."""
    tiny_template: ClassVar[str] = ""
    """The tiny tokenizer's chat template."""

    @classmethod
    def tiny_config(cls, spec: TinySpec, ids: Mapping[str, int]) -> dict[str, Any]:
        """The HF config dict of a tiny model of this family (``ids``: the tiny tokenizer's special tokens)."""
        raise NotImplementedError(f"no tiny model of {cls.label}")

    class_name: ClassVar[str] = ""
    """The transformers model class (by name); empty: the Auto class for image-text or causal LM models."""
    processor_class_path: ClassVar[str] = ""
    """``module:Class`` of the family's image processor (its PIL backend); empty: ``AutoImageProcessor``."""
    tiny_processor_settings: ClassVar[dict[str, Any]] = {}
    """The tiny model's image processor settings."""
    tiny_source: ClassVar[str] = ""
    """A family without a tiny model of its own: the tiny family whose tokenizer ``random:`` models borrow."""

    @classmethod
    def processor_class(cls) -> Any:
        import importlib

        module, name = cls.processor_class_path.split(":")
        return getattr(importlib.import_module(module), name)

    @classmethod
    def tiny_processor(cls) -> Any:
        """The image processor saved beside a tiny model (None: a text family)."""
        return cls.processor_class()(**cls.tiny_processor_settings) if cls.processor_class_path else None

    @classmethod
    def tiny_family(cls) -> str:
        """The tiny family whose tokenizer and processor a ``random:`` model of this family takes ("" for none)."""
        return cls.model_types[0] if cls.tiny_tokens and cls.model_types else cls.tiny_source

    def __init__(self, hf_config: Mapping[str, Any]) -> None:
        self.hf_config = resolved_config(hf_config)
        """The model's config with every setting ``config.json`` leaves out at its transformers class default."""
        self.model_type = str(self.hf_config["model_type"])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.model_type})"

    # ------------------------------------------------------------------ the model

    @property
    def vision(self) -> bool:
        return "vision_config" in self.hf_config

    def model_class(self) -> Any:
        """The transformers class ``from_pretrained`` is called on."""
        import transformers

        if self.class_name:
            return getattr(transformers, self.class_name)
        return transformers.AutoModelForImageTextToText if self.vision else transformers.AutoModelForCausalLM

    def image_processor(self, folder: str) -> Any:
        """The folder's image processor (PIL backend where transformers has one); None for a text model."""
        if not self.vision:
            return None
        if self.processor_class_path:
            return self.processor_class().from_pretrained(folder)
        from transformers import AutoImageProcessor

        return AutoImageProcessor.from_pretrained(folder, backend="pil")

    @staticmethod
    def bound_processor(processor: Any, min_pixels: int, max_pixels: int) -> None:
        """Keep an area-bounded image processor (``size`` in ``shortest_edge`` / ``longest_edge`` pixels) within
        the data's pixel bounds: images are sized by the data pipeline, and the processor must not resize them
        again. Fixed-size and tiling processors are left alone."""
        if processor is not None and "shortest_edge" in (getattr(processor, "size", None) or {}):
            processor.size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}

    def inner(self, model: nn.Module) -> Any:
        """The model under the LM head (``model.model``: the module that holds the language model, or the decoder
        layers of a text model), found through PEFT and FSDP wrappers."""
        for module in model.modules():
            if "language_model" in module._modules or "layers" in module._modules:  # noqa: SLF001 - real children
                return module
        return model

    def _path(self, model: nn.Module, path: str) -> Optional[nn.Module]:
        if not path:
            return None
        found: Any = self.inner(model)
        for part in path.split("."):
            found = getattr(found, part, None)
            if found is None:
                return None
        return found

    def vision_tower(self, model: nn.Module) -> Optional[nn.Module]:
        """The vision tower module (None for a text model)."""
        return self._path(model, self.tower_path)

    def projectors(self, model: nn.Module) -> list[nn.Module]:
        return [m for m in (self._path(model, p) for p in self.projector_paths) if m is not None]

    def language_model(self, model: nn.Module) -> nn.Module:
        inner = self.inner(model)
        return getattr(inner, "language_model", inner)

    def decoder_layers(self, model: nn.Module) -> list[nn.Module]:
        layers = getattr(self.language_model(model), "layers", None)
        if layers is None:
            raise ValueError(f"{type(model).__name__}: no decoder layers found")
        return list(layers)

    def freeze(self, model: nn.Module, vision: bool, aligner: bool, llm: bool) -> None:
        """Turn off gradients of the vision tower, the projector and/or the language model (and an untied head)."""
        tower, projectors = self.vision_tower(model), self.projectors(model)
        skip = {id(p) for m in projectors for p in m.parameters()}
        if tower is not None and vision:
            for param in tower.parameters():
                if id(param) not in skip:
                    param.requires_grad_(False)
        if aligner:
            for projector in projectors:
                projector.requires_grad_(False)
        if llm:
            self.language_model(model).requires_grad_(False)
            if hasattr(model, "lm_head") and not getattr(model.config, "tie_word_embeddings", False):
                model.lm_head.requires_grad_(False)

    def lora_scope(self, model: nn.Module) -> str:
        """A regex prefix that keeps LoRA's ``all-linear`` on the language model."""
        return r".*language_model\." if self.vision else r".*layers\."

    def dedupe_images(self, model: nn.Module) -> Any:
        """Install hooks that run each distinct image through the tower once; None where the family has none."""
        return None

    def time_scale(self) -> Optional[float]:
        """Rope positions per second of video (None: temporal positions count patches, or no video)."""
        return None

    def takes_token_types(self) -> bool:
        """The forward takes ``mm_token_type_ids`` (easytrain's text/image/video marks)."""
        return False

    # ------------------------------------------------------------------ data

    def layout(self, processor: Any = None) -> Optional[Layout]:
        """How the data pipeline sizes this family's images (None: a text model, or images it cannot size)."""
        return None

    def vision_stream(self, processor: Any, images: Sequence[Sequence[Any]], videos: Sequence[Sequence[Any]],
                      order: Sequence[Sequence[int]]) -> dict[str, torch.Tensor]:
        raise NotImplementedError(f"{self}: no vision stream")

    def positions(self, input_ids: torch.Tensor, types: Optional[torch.Tensor], tensors: Mapping[str, Any],
                  attention_mask: torch.Tensor) -> torch.Tensor:
        """Position ids of a (left- or right-padded) batch; ``tensors``: its vision stream."""
        return text_positions(attention_mask)

    def visual_kwargs(self, tensors: Mapping[str, torch.Tensor], seconds_arg: bool = False) -> dict[str, torch.Tensor]:
        """The model's keyword arguments for a batch's vision stream."""
        return {}

    def model_kwargs(self, tensors: Mapping[str, torch.Tensor], seconds_arg: bool = False) -> dict[str, torch.Tensor]:
        """:meth:`visual_kwargs`, and the batch's ``mm_token_type_ids`` where the model takes them."""
        out = self.visual_kwargs(tensors, seconds_arg)
        if self.takes_token_types() and "mm_token_type_ids" in tensors:
            out["mm_token_type_ids"] = tensors["mm_token_type_ids"]
        return out

    def patch_geometry(self) -> tuple[int, int, int]:
        """(patch side in pixels, patches per token along a side, frames per patch) of the vision tower: what the
        planner prices ``pixel_values`` and the tower's activations by."""
        return side(self.hf_config["vision_config"]["patch_size"]), 1, 1

    def channels(self) -> int:
        """Colour channels of the vision tower's input."""
        return int(self.hf_config["vision_config"][self.channels_key])

    def visual_rows(self, grid: torch.Tensor) -> torch.Tensor:
        """Rows of ``pixel_values`` per visual (``grid``: the stream's ``image_grid_thw``)."""
        return grid.prod(-1)

    def visual_tokens(self, grid: torch.Tensor) -> list[int]:
        """Vision tokens per visual."""
        raise NotImplementedError(f"{self}: no vision tokens")

    def unsupported(self, feature: str) -> Optional[str]:
        """Why ``feature`` (one of :data:`FEATURES`) cannot serve this family, or None when it can."""
        if feature in self.features:
            return None
        return f"{self.label} ({self.model_type}) does not support {feature.replace('_', ' ')} in easytrain"


@dataclass
class Bound:
    """A family's adapter with the image processor and placeholder token ids: the vision inputs the collators
    build (:class:`easytrain.data.collate.Visuals`). Picklable: collators run in loader processes."""

    family: Family
    processor: Any
    image_token_id: int
    video_token_id: int = -1

    @classmethod
    def of(cls, family: Family, processor: Any, tokenizer: Any) -> "Bound":
        """``family`` with ``processor`` and the ids of its layout's placeholders in ``tokenizer`` (-1: absent)."""
        layout = family.layout(processor)
        if layout is None:
            raise ValueError(f"{family} has no image layout")
        vocab = tokenizer.get_vocab()
        return cls(family, processor, int(vocab.get(layout.image_token, -1)), int(vocab.get(layout.video_pad, -1)))

    def stream(self, images: Sequence[Sequence[Any]], videos: Sequence[Sequence[Any]],
               order: Sequence[Sequence[int]]) -> dict[str, torch.Tensor]:
        return self.family.vision_stream(self.processor, images, videos, order)

    def positions(self, input_ids: torch.Tensor, types: torch.Tensor, tensors: Mapping[str, Any],
                  attention_mask: torch.Tensor) -> torch.Tensor:
        return self.family.positions(input_ids, types, tensors, attention_mask)
