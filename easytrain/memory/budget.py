"""Exact arithmetic of the planner's sequence-dependent terms: tokens per sequence, the logits peak,
and the vLLM engine's memory (weights, KV cache and how many sequences it holds at once).

Pure functions of the composed config and the model's HF config; the planner composes them per role
and phase. Sizes are bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from easytrain.memory.params import hf_config_object
from easytrain.memory.states import DTYPE_BYTES

PATCH = 14
"""Vision patch side (pixels): :func:`image_tokens`' default; a model's own geometry is
:func:`easytrain.memory.vision.vision_geometry` (its family adapter's patches, tiles or fixed image)."""


def video_patches(data: Any) -> int:
    """Image-sized pieces the videos of one sample can hold: ``data.limit_videos`` videos of
    ``data.max_frames`` frames, two frames a temporal patch (a patch at ``data.max_pixels`` costs the vision
    tower and the language model what one image does); 0 without ``data.video_key``."""
    return data.limit_videos * -(-data.max_frames // 2) if data.video_key else 0


def image_tokens(max_pixels: int, merge: int = 2, patch: int = PATCH) -> int:
    """Language-model tokens of one image at ``data.max_pixels`` under dynamic resolution: a ``patch`` x
    ``patch`` patch per patch^2 pixels (14 px by default), merged ``merge`` x ``merge`` into one
    token."""
    return max_pixels // (patch * patch * merge * merge)


def tokens_per_image(hf_config: dict[str, Any], max_pixels: int) -> int:
    """Language-model tokens of one image at ``max_pixels`` for the model ``hf_config`` describes (its patch
    size, merge, tiles or fixed image: :mod:`easytrain.memory.vision`); 0 for a text-only model."""
    from easytrain.memory.vision import vision_geometry

    geometry = vision_geometry(hf_config)
    return geometry.image_tokens(max_pixels) if geometry is not None else 0


@dataclass(frozen=True)
class SequenceShape:
    prompt_text: int
    """Prompt tokens besides image tokens (``data.max_prompt_length`` bounds the whole prompt)."""
    images: int
    image_tokens: int
    response: int

    @property
    def prompt(self) -> int:
        return self.prompt_text + self.images * self.image_tokens

    @property
    def total(self) -> int:
        return self.prompt + self.response


def sequence_shape(config: Any, hf_config: dict[str, Any]) -> SequenceShape:
    """The longest sequence the data settings allow: the prompt budget holds the image tokens, and a
    prompt over ``data.max_prompt_length`` is filtered, so images at ``data.max_pixels`` that would
    overflow it are priced at the share of the budget they can take. Multi-turn tool images
    (``worker.rollout.multi_turn.max_tool_images``) count as images too: the sequence is no longer, but
    the vision tower sees more of it; so does each temporal patch of a video (:func:`video_patches`)."""
    d = config.data
    vision = getattr(hf_config_object(hf_config), "vision_config", None) if d.image_key else None
    turns = config.worker.rollout.multi_turn
    tool_images = turns.max_tool_images if turns.enable and config.trainer.task == "rl" else 0
    images = d.limit_images + tool_images + video_patches(d) if vision is not None else 0
    per_image = tokens_per_image(hf_config, d.max_pixels) if vision is not None else 0
    if images:
        per_image = min(per_image, d.max_prompt_length // images)
    text = d.max_prompt_length - images * per_image
    return SequenceShape(text, images, per_image, d.max_response_length)


def kv_bytes_per_token(hf_config: dict[str, Any], dtype: str, tensor_parallel: int = 1) -> int:
    """KV-cache bytes one token takes on one GPU: keys and values of every layer, KV heads split over
    the tensor-parallel ranks (replicated when there are fewer heads than ranks)."""
    text = hf_config_object(hf_config).get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads  # without head_dim: hidden / heads
    kv_per_rank = max(1, text.num_key_value_heads // tensor_parallel)
    return 2 * text.num_hidden_layers * kv_per_rank * head_dim * DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class EngineBudget:
    reserved: int
    """What vLLM takes of the GPU: ``gpu_memory_utilization`` x total."""
    weights: int
    """The engine's weights on one GPU (its tensor-parallel share, in ``model.dtype``)."""
    kv_cache: int
    """What is left of the reservation for the KV cache (0 if the weights do not fit)."""
    kv_per_token: int
    sequence_tokens: int

    @property
    def max_sequences(self) -> int:
        """Sequences of full length the KV cache holds at once."""
        return self.kv_cache // (self.kv_per_token * self.sequence_tokens) if self.sequence_tokens else 0


def engine_budget(gpu_bytes: int, utilization: float, total_params: int, hf_config: dict[str, Any], dtype: str,
                  tensor_parallel: int, sequence_tokens: int, activation_reserve: int = 0) -> EngineBudget:
    """vLLM's split of its reservation: weights, then (minus ``activation_reserve``, vLLM's profiled
    forward peak) the KV cache."""
    reserved = int(gpu_bytes * utilization)
    weights = -(-total_params // tensor_parallel) * DTYPE_BYTES[dtype]
    kv = max(0, reserved - weights - activation_reserve)
    return EngineBudget(reserved, weights, kv, kv_bytes_per_token(hf_config, dtype, tensor_parallel),
                        sequence_tokens)
