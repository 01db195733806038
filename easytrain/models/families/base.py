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

This base class is the generic adapter, for a ``model_type`` without an
adapter of its own: a text causal LM, or an image-text model
(``AutoModelForImageTextToText``) that follows transformers' common
fixed-size interface, as LLaVA-1.5 does (:class:`FixedImage`): every image is
resized to one ``vision_config.image_size`` square and takes the config's
fixed count of vision tokens (``image_seq_length`` or
``mm_tokens_per_image``); the chat template writes the image token
(``image_token_id`` / ``image_token_index``, named by the tokenizer) once per
image, expanded to one per vision token; the forward takes ``pixel_values``
(one ``C x S x S`` image per placeholder) and plain positions; the tower and
projector sit at ``vision_tower`` and ``multi_modal_projector``. An
image-text model whose config lacks any of these settings (or cuts images
into crops or tiles: ``image_grid_pinpoints``, ``downsample_ratio``) trains
its text only: images are a config error. Features that need family knowledge (video, image dedup, prompt
sharing, padding-free, Ulysses, vLLM, tool images, KV-cache reuse) are off
for it. Gemma 3's adapter shares the fixed-size path and adds its own
placeholder expansion and bidirectional image attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Optional, Sequence

import torch
from torch import nn

from easytrain.data.collate import text_positions
from easytrain.data.vision import Layout


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

    model_type = str(hf_config["model_type"])
    settings = {k: v for k, v in hf_config.items() if k != "model_type" and v is not None}  # unset ids
    try:
        return dict(AutoConfig.for_model(model_type, **settings).to_dict())
    except ValueError:  # an unknown model_type: only its own settings are known
        return {"model_type": model_type, **settings}


def side(value: Any) -> int:
    """A size given as one number or an (height, width) pair."""
    return int(value[0] if isinstance(value, (list, tuple)) else value)


STAND_IN_IMAGE = "<image>"
"""The generic adapter's placeholder name where no tokenizer is at hand (planning, config checks: only the
layout's geometry is read there)."""


@dataclass(frozen=True)
class FixedImage:
    """transformers' common fixed-size image interface, as a model's config states it (LLaVA-1.5, Gemma 3): every
    image is resized to one ``side x side`` square and becomes ``tokens`` vision tokens, which the model finds at
    the token ``token_id`` (one per vision token)."""

    side: int
    tokens: int
    token_id: int


def _first(hf_config: Mapping[str, Any], keys: Sequence[str]) -> Any:
    """The value of the first of ``keys`` that a model's ``config.json`` (``hf_config``) sets (None: none)."""
    return next((hf_config[k] for k in keys if hf_config.get(k) is not None), None)


class Family:
    """The generic adapter (see the module docstring); families subclass it and override what differs."""

    model_types: ClassVar[tuple[str, ...]] = ()
    """HF ``model_type`` values this adapter serves."""
    label: ClassVar[str] = "any other transformers model (generic)"
    features: ClassVar[frozenset[str]] = frozenset()
    """Which of :data:`FEATURES` serve the family (the generic adapter: none of them)."""
    rope_rows: ClassVar[bool] = False
    """Positions are multimodal rotary rows (3, B, L) rather than (B, L)."""
    tower_path: ClassVar[str] = "vision_tower"
    """Attribute path of the vision tower from the inner model (``model.model``), e.g. ``visual``; the generic
    adapter: transformers' common name (absent in a text model)."""
    projector_paths: ClassVar[tuple[str, ...]] = ("multi_modal_projector",)
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
    image_tokens_keys: ClassVar[tuple[str, ...]] = ("image_seq_length", "mm_tokens_per_image")
    """Config keys of the fixed-size path's vision tokens per image (:meth:`fixed_image`; the first set counts)."""
    image_token_keys: ClassVar[tuple[str, ...]] = ("image_token_id", "image_token_index")
    """Config keys of the fixed-size path's image token id."""
    tiling_keys: ClassVar[tuple[str, ...]] = ("image_grid_pinpoints", "downsample_ratio")
    """Config keys that say an image is cut into crops or tiles (LLaVA-NeXT's any-resolution grid, pixel-shuffled
    tiles), which the fixed-size path would miscount: a config that sets one has no :meth:`fixed_image`."""
    image_call: ClassVar[dict[str, Any]] = {}
    """Keyword arguments of the fixed-size path's image processor call (Gemma 3: no pan-and-scan crops)."""
    unsupported_why: ClassVar[Mapping[str, str]] = {}
    """Why a feature outside :attr:`features` is, where there is more to say than that it is not built."""
    tiny_tokens: ClassVar[tuple[str, ...]] = ()
    """Special tokens of the family's tiny tokenizer (eos ``<|im_end|>`` and pad ``<|endoftext|>`` among them);
    empty: no tiny model of this family."""
    tiny_template: ClassVar[str] = ""
    """The tiny tokenizer's chat template."""
    tiny_named_tokens: ClassVar[Mapping[str, str]] = {}
    """Tokenizer attributes (name -> one of :attr:`tiny_tokens`) the family's transformers processor reads, which
    vLLM builds from the model folder (InternVL's ``start_image_token``, Gemma 3's ``boi_token``)."""
    tiny_processor_config: ClassVar[Mapping[str, Any]] = {}
    """The tiny folder's ``processor_config.json`` (as the published folders have one: the processor class and
    its tokens per image, which vLLM's processing reads); empty: none written."""

    @classmethod
    def tiny_config(cls, spec: TinySpec, ids: Mapping[str, int]) -> dict[str, Any]:
        """The HF config dict of a tiny model of this family (``ids``: the tiny tokenizer's special tokens)."""
        raise NotImplementedError(f"no tiny model of {cls.label}")

    class_name: ClassVar[str] = ""
    """The transformers model class (by name); empty: the class transformers' image-text or causal-LM Auto class
    maps the ``model_type`` to (:meth:`model_class`)."""
    processor_class_path: ClassVar[str] = ""
    """``module:Class`` of the family's image processor (its PIL backend, unless the adapter says why not); empty:
    ``AutoImageProcessor``."""
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
        """The transformers class ``from_pretrained`` is called on: the family's, or (the generic adapter) the
        class transformers' image-text or causal-LM Auto class maps the ``model_type`` to, which also builds the
        model on the meta device (``_from_config``: sharded loads, ``random:`` models); the Auto class itself for
        a ``model_type`` this transformers does not know."""
        import transformers
        from transformers.models.auto import modeling_auto

        if self.class_name:
            return getattr(transformers, self.class_name)
        names = (modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES if self.vision
                 else modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
        found = getattr(transformers, str(names.get(self.model_type, "")), None)
        if found is not None:
            return found
        return transformers.AutoModelForImageTextToText if self.vision else transformers.AutoModelForCausalLM

    def image_processor(self, folder: str) -> Any:
        """The folder's image processor (:attr:`processor_class_path`, else the PIL backend where transformers has
        one); None for a text model."""
        if not self.vision:
            return None
        if self.processor_class_path:
            return self.processor_class().from_pretrained(folder)
        from transformers import AutoImageProcessor

        return AutoImageProcessor.from_pretrained(folder, backend="pil")

    def bound_processor(self, processor: Any, min_pixels: int, max_pixels: int) -> None:
        """Keep an area-bounded image processor (``size`` in ``shortest_edge`` / ``longest_edge`` pixels) within
        the data's pixel bounds: images are sized by the data pipeline, and the processor must not resize them
        again. Fixed-size and tiling processors are left alone (a fixed-size family's images already have the
        processor's size, whose ``shortest_edge`` is a side in pixels: CLIP's)."""
        if processor is None or "shortest_edge" not in (getattr(processor, "size", None) or {}):
            return
        layout = self.layout(processor)
        if layout is None or not (layout.fixed_size or layout.thumbnail):
            processor.size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}

    def vllm_prompt_ids(self, ids: list[int]) -> list[int]:
        """The token ids of a prompt with images as vLLM takes them beside the images (``multi_modal_data``): it
        expands each image's placeholder itself, so a prompt easytrain already expanded goes back to one
        placeholder per image (the generic adapter: unchanged; only families that serve ``vllm`` with images
        are asked)."""
        return ids

    def vllm_processor_kwargs(self, min_pixels: int, max_pixels: int) -> dict[str, Any]:
        """vLLM's ``mm_processor_kwargs`` that keep its image processor from resizing images the data pipeline
        already sized within [min_pixels, max_pixels] (none: the processor's own settings)."""
        return {}

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
        """Install hooks that run each distinct image through the tower once (a tower that takes a batch of
        whole images: each distinct one once); None where the family has no ``image_dedup`` or no tower."""
        if "image_dedup" not in self.features:
            return None
        from easytrain.models.image_dedup import dedupe_batched

        tower = self.vision_tower(model)
        return dedupe_batched(tower) if tower is not None else None

    def time_scale(self) -> Optional[float]:
        """Rope positions per second of video (None: temporal positions count patches, or no video)."""
        return None

    def takes_token_types(self) -> bool:
        """The forward takes ``mm_token_type_ids`` (easytrain's text/image/video marks)."""
        return False

    # ------------------------------------------------------------------ data

    def fixed_image(self) -> Optional[FixedImage]:
        """The common fixed-size image interface as the config states it: ``vision_config.image_size``, the vision
        tokens per image (:attr:`image_tokens_keys`) and the image token id (:attr:`image_token_keys`); None for a
        text model, or a config that lacks one of them or sets one of :attr:`tiling_keys`."""
        vision = self.hf_config.get("vision_config")
        if not isinstance(vision, Mapping) or vision.get("image_size") is None:
            return None
        tokens, token_id = _first(self.hf_config, self.image_tokens_keys), _first(self.hf_config,
                                                                                  self.image_token_keys)
        if tokens is None or token_id is None or _first(self.hf_config, self.tiling_keys) is not None:
            return None
        return FixedImage(side(vision["image_size"]), int(tokens), int(token_id))

    def _fixed(self) -> FixedImage:
        image = self.fixed_image()
        if image is None:
            raise NotImplementedError(f"{self}: no fixed-size image interface in its config")
        return image

    def layout(self, processor: Any = None, tokenizer: Any = None) -> Optional[Layout]:
        """How the data pipeline sizes this family's images (None: a text model, or images it cannot size).
        ``tokenizer``: the model's, where the layout names a placeholder by its id (the generic adapter: the
        config's image token; without one a stand-in name, for callers that read only the geometry)."""
        image = self.fixed_image()
        if image is None:
            return None
        return Layout(factor=image.side, tokens_per_cell=image.tokens, fixed_size=True,
                      image_pad=self._token_name(image.token_id, tokenizer))

    def _token_name(self, token_id: int, tokenizer: Any) -> str:
        """The tokenizer's token for the config's image token id, checked to stay one token when repeated (the
        placeholder is expanded to one per vision token)."""
        if tokenizer is None:
            return STAND_IN_IMAGE
        name = tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self}: the tokenizer has no token for the config's image token id {token_id}")
        if tokenizer(name * 2, add_special_tokens=False)["input_ids"] != [token_id] * 2:
            raise ValueError(f"{self}: the tokenizer does not keep the image token {name!r} (id {token_id}) as one "
                             "token when it is repeated; it must be an added (special) token")
        return name

    def vision_stream(self, processor: Any, images: Sequence[Sequence[Any]], videos: Sequence[Sequence[Any]],
                      order: Sequence[Sequence[int]]) -> dict[str, torch.Tensor]:
        """The fixed-size path: one processor call for the batch's images (already resized to the square by the
        data pipeline); an image is one row of ``pixel_values`` (its ``C x S x S`` values flattened) with
        ``image_grid_thw`` ``(1, 1, 1)``."""
        if any(videos):
            raise ValueError(f"{self.label} ({self.model_type}) takes no videos in easytrain")
        image = self._fixed()
        flat = [im for sample in images for im in sample]
        if not flat:
            return {}
        pixels = processor(images=flat, return_tensors="pt", **self.image_call)["pixel_values"]
        want = (len(flat), self.channels(), image.side, image.side)
        if tuple(pixels.shape) != want:
            raise ValueError(f"{self}: the image processor gave pixel_values of shape {tuple(pixels.shape)}, the "
                             f"model takes {want} (vision_config.image_size={image.side})")
        return {"pixel_values": pixels.reshape(len(flat), -1).float(),
                "image_grid_thw": torch.ones(len(flat), 3, dtype=torch.long),
                "visual_seconds": torch.zeros(len(flat), dtype=torch.float32)}

    def positions(self, input_ids: torch.Tensor, types: Optional[torch.Tensor], tensors: Mapping[str, Any],
                  attention_mask: torch.Tensor) -> torch.Tensor:
        """Position ids of a (left- or right-padded) batch; ``tensors``: its vision stream."""
        return text_positions(attention_mask)

    def decode_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """The ``position_ids`` a decoding forward takes for the text positions ``positions`` (B, T)."""
        return positions

    def begin_prefill(self, model: nn.Module) -> None:
        """Before the HF engine's prefill: forget what the model kept from the last batch (nothing here)."""

    def prefill_offsets(self, model: nn.Module, rows: int, device: torch.device) -> torch.Tensor:
        """Per row of the last prefill, how far the next position lies past the row's token count (the text
        position: zeros)."""
        return torch.zeros(rows, dtype=torch.long, device=device)

    def visual_kwargs(self, tensors: Mapping[str, torch.Tensor], seconds_arg: bool = False) -> dict[str, torch.Tensor]:
        """The model's keyword arguments for a batch's vision stream (the fixed-size path: the images, each
        ``C x S x S``)."""
        if "pixel_values" not in tensors:
            return {}
        image = self._fixed()
        return {"pixel_values": tensors["pixel_values"].reshape(-1, self.channels(), image.side, image.side)}

    def model_kwargs(self, tensors: Mapping[str, torch.Tensor], seconds_arg: bool = False) -> dict[str, torch.Tensor]:
        """:meth:`visual_kwargs`, and the batch's ``mm_token_type_ids`` where the model takes them."""
        out = self.visual_kwargs(tensors, seconds_arg)
        if self.takes_token_types() and "mm_token_type_ids" in tensors:
            out["mm_token_type_ids"] = tensors["mm_token_type_ids"]
        return out

    def patch_geometry(self) -> tuple[int, int, int]:
        """(patch side in pixels, patches per token along a side, frames per patch) of the vision tower: what the
        planner prices ``pixel_values`` and the tower's activations by (the fixed-size path: the patches of the
        square pooled to its token count, Gemma 3's 4 x 4; one patch a token for LLaVA)."""
        patch = side(self.hf_config["vision_config"]["patch_size"])
        image = self.fixed_image()
        if image is None:
            return patch, 1, 1
        return patch, max(1, (image.side // patch) // max(1, math.isqrt(image.tokens))), 1

    def channels(self) -> int:
        """Colour channels of the vision tower's input."""
        return int(self.hf_config["vision_config"][self.channels_key])

    def visual_rows(self, grid: torch.Tensor) -> torch.Tensor:
        """Rows of ``pixel_values`` per visual (``grid``: the stream's ``image_grid_thw``)."""
        return grid.prod(-1)

    def visual_tokens(self, grid: torch.Tensor) -> list[int]:
        """Vision tokens per visual (the fixed-size path: the config's count for each image)."""
        return [self._fixed().tokens] * int(grid.shape[0])

    def unsupported(self, feature: str) -> Optional[str]:
        """Why ``feature`` (one of :data:`FEATURES`) cannot serve this family, or None when it can."""
        if feature in self.features:
            return None
        why = f": {self.unsupported_why[feature]}" if feature in self.unsupported_why else ""
        return f"{self.label} ({self.model_type}) does not support {feature.replace('_', ' ')} in easytrain{why}"


@dataclass
class Bound:
    """A family's adapter with the image processor and placeholder token ids: the vision inputs the collators
    build (:class:`easytrain.data.collate.Visuals`). Picklable: collators run in loader processes."""

    family: Family
    processor: Any
    layout: Layout
    """The family's layout, its placeholders named by the model's tokenizer."""
    image_token_id: int
    video_token_id: int = -1

    @classmethod
    def of(cls, family: Family, processor: Any, tokenizer: Any) -> "Bound":
        """``family`` with ``processor`` and the ids of its layout's placeholders in ``tokenizer`` (-1: absent)."""
        layout = family.layout(processor, tokenizer)
        if layout is None:
            raise ValueError(f"{family} has no image layout")
        vocab = tokenizer.get_vocab()
        return cls(family, processor, layout, int(vocab.get(layout.image_token, -1)),
                   int(vocab.get(layout.video_pad, -1)))

    def stream(self, images: Sequence[Sequence[Any]], videos: Sequence[Sequence[Any]],
               order: Sequence[Sequence[int]]) -> dict[str, torch.Tensor]:
        return self.family.vision_stream(self.processor, images, videos, order)

    def positions(self, input_ids: torch.Tensor, types: torch.Tensor, tensors: Mapping[str, Any],
                  attention_mask: torch.Tensor) -> torch.Tensor:
        return self.family.positions(input_ids, types, tensors, attention_mask)
