"""The Qwen families: Qwen2 (text), Qwen2-VL, Qwen2.5-VL and Qwen3-VL.

Qwen-VL models see an image as ``grid_t x grid_h x grid_w`` patches (14 px;
16 for Qwen3-VL), merged ``merge x merge`` into one token each; a video is the
same tower's input with ``grid_t > 1`` (frame pairs form one temporal patch).
The vision stream is the patch rows of every visual back to back
(``pixel_values``), a grid row per visual (``image_grid_thw``) and the seconds
one temporal patch spans (``visual_seconds``, 0 for an image). Positions are
multimodal rotary rows (temporal, height, width): text advances all three, a
visual takes offsets from where it starts.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any, ClassVar, Mapping, Optional, Sequence

import numpy as np
import torch
from torch import nn

from easytrain.data.images import BadSample, to_rgb
from easytrain.data.vision import MM_TEXT, MM_VIDEO, Layout
from easytrain.models.families.base import FEATURES, Family, TinySpec
from easytrain.models.families.templates import CHATML_TOKENS, chatml_template

if TYPE_CHECKING:
    from PIL import Image

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")

CHAT_TEMPLATE = chatml_template("<|vision_start|><|image_pad|><|vision_end|>",
                                "<|vision_start|><|video_pad|><|vision_end|>")
"""Qwen-VL's: an image (video) becomes <|vision_start|><|image_pad|><|vision_end|> (<|video_pad|>), which
easytrain expands to one pad per vision token."""


def mrope_section(head_dim: int) -> list[int]:
    """Temporal/height/width split of the rotary half-dim (sums to head_dim // 2), Qwen's 1:1.5:1.5."""
    half = head_dim // 2
    t = half // 4
    h = (half - t) // 2
    return [t, h, half - t - h]


def text_config(spec: TinySpec, ids: Mapping[str, int]) -> dict[str, Any]:
    """The language model settings of a tiny Qwen model."""
    return {
        "vocab_size": spec.vocab, "hidden_size": spec.hidden, "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers, "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "hidden_act": "silu", "use_cache": True,
        "bos_token_id": ids.get("<|endoftext|>"), "eos_token_id": ids.get("<|im_end|>"),
        "pad_token_id": ids.get("<|endoftext|>"),
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
    }


class Qwen2(Family):
    model_types = ("qwen2",)
    label = "Qwen2 / Qwen2.5 (text)"
    features = frozenset({"padding_free", "ulysses", "vllm", "shared_prompt", "kv_reuse"})
    tiny_tokens: ClassVar[tuple[str, ...]] = CHATML_TOKENS + VISION_TOKENS
    tiny_template: ClassVar[str] = CHAT_TEMPLATE
    class_name = "Qwen2ForCausalLM"

    @classmethod
    def tiny_config(cls, spec: TinySpec, ids: Mapping[str, int]) -> dict[str, Any]:
        return {"model_type": "qwen2", "tie_word_embeddings": True, **text_config(spec, ids)}


def rope_positions(input_ids: torch.Tensor, token_types: torch.Tensor, image_grid_thw: Optional[torch.Tensor],
                   attention_mask: torch.Tensor, merge_size: int = 2,
                   visual_seconds: Optional[torch.Tensor] = None,
                   tokens_per_second: Optional[float] = None) -> torch.Tensor:
    """Qwen-VL 3-D rope positions ``(3, batch, length)`` for text, images and videos.

    Text advances all three axes together; a visual of ``t x h x w`` merged
    patches takes temporal/height/width offsets from the position where it
    starts, and the text after it resumes at ``start + max(h, w)``. A video's
    temporal offsets step by ``tokens_per_second * visual_seconds`` per
    temporal patch (Qwen2.5-VL: positions keep real time; None for Qwen2-VL,
    which steps by 1). ``image_grid_thw`` and ``visual_seconds`` are the
    batch's vision stream (images and videos in text order). Padding gets
    position 0.
    """
    positions = torch.zeros(3, *input_ids.shape, dtype=torch.long)
    grids = iter(image_grid_thw.tolist()) if image_grid_thw is not None else iter(())
    seconds = iter(visual_seconds.tolist()) if visual_seconds is not None else itertools.repeat(0.0)
    for b in range(input_ids.shape[0]):
        keep = attention_mask[b].bool()
        types = token_types[b][keep].tolist()
        pieces = []
        current = 0
        for kind, group in itertools.groupby(types):
            length = len(list(group))
            if kind == MM_TEXT:
                pieces.append(torch.arange(current, current + length).expand(3, -1))
                current += length
                continue
            t, h, w = next(grids)
            step = next(seconds)
            # float32 like the model's own spacing (second_per_grid_ts), so the truncation below rounds alike
            interval = (tokens_per_second * torch.tensor(step, dtype=torch.float32)
                        if kind == MM_VIDEO and tokens_per_second else 1)
            gh, gw = h // merge_size, w // merge_size
            times = (torch.arange(t) * interval).long()
            tt, hh, ww = torch.meshgrid(times, torch.arange(gh), torch.arange(gw), indexing="ij")
            block = torch.stack([tt, hh, ww]).reshape(3, -1) + current
            if block.shape[1] != length:
                raise ValueError(f"sample {b}: image grid {t}x{h}x{w} gives {block.shape[1]} tokens, "
                                 f"the text holds {length}")
            pieces.append(block)
            current += max(gh, gw)
        positions[:, b, keep] = torch.cat(pieces, dim=1)
    return positions


class Qwen2VL(Family):
    """Qwen2-VL; the base of the Qwen-VL line."""

    model_types = ("qwen2_vl",)
    label = "Qwen2-VL"
    features = frozenset(FEATURES)
    rope_rows = True
    tower_path = "visual"
    projector_paths = ("visual.merger",)
    tiny_tokens: ClassVar[tuple[str, ...]] = CHATML_TOKENS + VISION_TOKENS
    tiny_template: ClassVar[str] = CHAT_TEMPLATE
    default_patch: ClassVar[int] = 14
    class_name = "Qwen2VLForConditionalGeneration"
    processor_class_path = "transformers.models.qwen2_vl:Qwen2VLImageProcessorPil"
    tiny_processor_settings = {"patch_size": 14}

    channels_key = "in_channels"

    @property
    def vision_settings(self) -> dict[str, Any]:
        return dict(self.hf_config["vision_config"])

    @property
    def patch(self) -> int:
        return int(self.vision_settings["patch_size"])

    @property
    def merge(self) -> int:
        return int(self.vision_settings["spatial_merge_size"])


    @classmethod
    def tiny_vision(cls, spec: TinySpec) -> dict[str, Any]:
        return {"depth": spec.vision_depth, "embed_dim": spec.vision_hidden, "num_heads": spec.vision_heads,
                "mlp_ratio": spec.vision_intermediate // spec.vision_hidden, "hidden_size": spec.hidden}

    @classmethod
    def tiny_config(cls, spec: TinySpec, ids: Mapping[str, int]) -> dict[str, Any]:
        text = text_config(spec, ids)
        text["rope_parameters"]["mrope_section"] = mrope_section(spec.head_dim)
        return {
            "model_type": cls.model_types[0], "text_config": text, "vision_config": cls.tiny_vision(spec),
            "tie_word_embeddings": True,
            "image_token_id": ids.get("<|image_pad|>"), "video_token_id": ids.get("<|video_pad|>"),
            "vision_start_token_id": ids.get("<|vision_start|>"), "vision_end_token_id": ids.get("<|vision_end|>"),
        }

    def takes_token_types(self) -> bool:
        return True

    def decode_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """Text positions on every rope axis (3, B, T)."""
        return positions[None].expand(3, -1, -1)

    def begin_prefill(self, model: nn.Module) -> None:
        """The model keeps the last prefill's rope offsets (``rope_deltas``) and would reuse them: the prefill
        computes this batch's from its images."""
        self.inner(model).rope_deltas = None

    def prefill_offsets(self, model: nn.Module, rows: int, device: torch.device) -> torch.Tensor:
        """The rope offsets the prefill computed from each row's images (zeros after a text-only prefill, which
        was given its positions)."""
        deltas = getattr(self.inner(model), "rope_deltas", None)
        if deltas is None:
            return super().prefill_offsets(model, rows, device)
        return deltas.reshape(-1).to(device)

    def vllm_prompt_ids(self, ids: list[int]) -> list[int]:
        """Each run of image (or video) pads back to one pad: vLLM's processor replaces a pad by as many as the
        image it is given takes (the same count, the image being sized already)."""
        pads = {self.hf_config["image_token_id"], self.hf_config["video_token_id"]}  # (resolved: always set)
        return [t for k, t in enumerate(ids) if not (t in pads and k > 0 and ids[k - 1] == t)]

    def vllm_processor_kwargs(self, min_pixels: int, max_pixels: int) -> dict[str, Any]:
        """The processor's area bounds (transformers' ``size``: its ``min_pixels``/``max_pixels`` arguments are
        deprecated): images arrive sized within them and are not resized again."""
        return {"size": {"shortest_edge": min_pixels, "longest_edge": max_pixels}}

    def patch_geometry(self) -> tuple[int, int, int]:
        return self.patch, self.merge, int(self.vision_settings["temporal_patch_size"])

    def layout(self, processor: Any = None, tokenizer: Any = None) -> Layout:
        patch = int(getattr(processor, "patch_size", None) or self.patch)
        merge = int(getattr(processor, "merge_size", None) or self.merge)
        return Layout(factor=patch * merge)

    def vision_stream(self, processor: Any, images: Sequence[Sequence[Any]], videos: Sequence[Sequence[Any]],
                      order: Sequence[Sequence[int]]) -> dict[str, torch.Tensor]:
        """Images through the image processor in one call, videos through
        :func:`video_patches`, each sample's visuals in text order."""
        flat = [im for sample in images for im in sample]
        if not flat and not any(videos):
            return {}
        pixels: list[torch.Tensor] = []
        grids: list[torch.Tensor] = []
        if flat:
            processed = processor(images=flat, return_tensors="pt")
            sizes = processed["image_grid_thw"].prod(-1).tolist()
            pixels = list(torch.split(processed["pixel_values"], sizes))
            grids = list(processed["image_grid_thw"])
        image_iter = iter(zip(pixels, grids))
        out_pixels, out_grids, seconds = [], [], []
        for sample_videos, kinds in zip(videos, order):
            video_iter = iter(sample_videos)
            for kind in kinds:
                if kind == MM_VIDEO:
                    clip = next(video_iter)
                    patch, grid = video_patches(clip.frames, processor)
                    out_pixels.append(patch)
                    out_grids.append(grid[0])
                    seconds.append(clip.seconds_per_patch)
                else:
                    patch, grid = next(image_iter)
                    out_pixels.append(patch)
                    out_grids.append(grid)
                    seconds.append(0.0)
        return {"pixel_values": torch.cat(out_pixels), "image_grid_thw": torch.stack(out_grids),
                "visual_seconds": torch.tensor(seconds, dtype=torch.float32)}

    def positions(self, input_ids: torch.Tensor, types: Optional[torch.Tensor], tensors: Mapping[str, Any],
                  attention_mask: torch.Tensor) -> torch.Tensor:
        if types is None:
            types = torch.zeros_like(input_ids)
        return rope_positions(input_ids, types, tensors.get("image_grid_thw"), attention_mask, self.merge,
                              tensors.get("visual_seconds"), self.time_scale())

    def visual_kwargs(self, tensors: Mapping[str, torch.Tensor], seconds_arg: bool = False) -> dict[str, torch.Tensor]:
        """``pixel_values``/``image_grid_thw`` for the still images and ``pixel_values_videos``/``video_grid_thw``
        for the videos, each in stream order (the model scatters them onto its image and video tokens in text
        order). ``seconds_arg``: also ``second_per_grid_ts`` (Qwen2.5-VL's temporal rope spacing, used where the
        model computes positions itself: a generation's prefill)."""
        if "pixel_values" not in tensors:
            return {}
        pixels, grid = tensors["pixel_values"], tensors["image_grid_thw"]
        seconds = tensors.get("visual_seconds")
        if seconds is None or not bool((seconds > 0).any()):
            return {"pixel_values": pixels, "image_grid_thw": grid}
        video = seconds > 0
        rows = video.to(grid.device).repeat_interleave(grid.prod(-1))
        out = {"pixel_values_videos": pixels[rows.to(pixels.device)], "video_grid_thw": grid[video.to(grid.device)]}
        if seconds_arg and self.time_scale() is not None:
            out["second_per_grid_ts"] = seconds[video]
        if not bool(video.all()):
            out.update(pixel_values=pixels[~rows.to(pixels.device)], image_grid_thw=grid[~video.to(grid.device)])
        return out

    def visual_tokens(self, grid: torch.Tensor) -> list[int]:
        return [int(n) for n in (grid.prod(dim=-1) // (self.merge * self.merge)).tolist()]

    def dedupe_images(self, model: nn.Module) -> Any:
        from easytrain.models.image_dedup import dedupe_patch_rows

        tower = self.vision_tower(model)
        return dedupe_patch_rows(tower, self.merge) if tower is not None else None


class Qwen25VL(Qwen2VL):
    model_types = ("qwen2_5_vl",)
    label = "Qwen2.5-VL"
    class_name = "Qwen2_5_VLForConditionalGeneration"
    gated_vision_mlp = True

    @classmethod
    def tiny_vision(cls, spec: TinySpec) -> dict[str, Any]:
        return {"depth": spec.vision_depth, "hidden_size": spec.vision_hidden, "num_heads": spec.vision_heads,
                "intermediate_size": spec.vision_intermediate, "out_hidden_size": spec.hidden,
                "window_size": 112, "fullatt_block_indexes": list(range(1, spec.vision_depth, 2))}

    def time_scale(self) -> Optional[float]:
        """``vision_config.tokens_per_second``: video positions keep real time."""
        return float(self.vision_settings["tokens_per_second"])


class Qwen3VL(Qwen2VL):
    """Qwen3-VL (dense): 16-px patches, interleaved multimodal rotary, DeepStack features added to the first
    decoder layers. Its videos put a timestamp before every temporal patch, which easytrain does not write yet
    (no video); DeepStack adds features at the image tokens of the whole sequence, which Ulysses' chunks cannot
    take (no sequence parallelism); multi-turn tool images are sized for the 28-px grid (not yet). vLLM serves
    Qwen3-VL on GPU (``Qwen3VLForConditionalGeneration``); on CPU its build serves text models only."""

    model_types = ("qwen3_vl",)
    label = "Qwen3-VL"
    features = frozenset(FEATURES) - {"video", "ulysses", "multi_turn_images"}
    projector_paths = ("visual.merger", "visual.deepstack_merger_list")
    default_patch = 16
    class_name = "Qwen3VLForConditionalGeneration"
    qk_norm = True
    tiny_processor_settings = {"patch_size": 16, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}

    @classmethod
    def tiny_vision(cls, spec: TinySpec) -> dict[str, Any]:
        return {"depth": spec.vision_depth, "hidden_size": spec.vision_hidden, "num_heads": spec.vision_heads,
                "intermediate_size": spec.vision_intermediate, "out_hidden_size": spec.hidden,
                "patch_size": cls.default_patch, "num_position_embeddings": 64,
                "deepstack_visual_indexes": list(range(min(spec.vision_depth, spec.layers)))}

    @classmethod
    def tiny_config(cls, spec: TinySpec, ids: Mapping[str, int]) -> dict[str, Any]:
        config = super().tiny_config(spec, ids)
        config["text_config"]["head_dim"] = spec.head_dim
        config["text_config"]["rope_parameters"]["mrope_interleaved"] = True
        return config


class Qwen3VLMoe(Qwen3VL):
    """Qwen3-VL's mixture-of-experts language model (30B-A3B): the dense family's inputs; no tiny model of its
    own (``random:`` presets take tiny Qwen3-VL's tokenizer)."""

    model_types = ("qwen3_vl_moe",)
    label = "Qwen3-VL MoE"
    tiny_tokens = ()
    tiny_source = "qwen3_vl"
    class_name = "Qwen3VLMoeForConditionalGeneration"


class Qwen35(Qwen3VL):
    """Qwen3.5: Qwen3-VL's inputs (without DeepStack) and a hybrid language model, Gated DeltaNet (linear
    attention) layers between full-attention ones. A linear-attention layer runs over the whole row in order and
    takes no attention mask beyond padding, so the passes that lay several samples or a shared prompt into one
    row (padding-free, prompt sharing, Ulysses) cannot serve it: it trains padded. Its cache's linear-attention
    states cannot be copied or dropped by row, so the HF engine generates each row with ``generate``."""

    model_types = ("qwen3_5",)
    label = "Qwen3.5"
    features = frozenset({"image_dedup"})
    projector_paths = ("visual.merger",)
    class_name = "Qwen3_5ForConditionalGeneration"
    qk_norm = True
    rotary_fraction: ClassVar[float] = 0.25
    """Qwen3.5 rotates a quarter of each head's dimensions (``partial_rotary_factor``)."""

    @classmethod
    def tiny_vision(cls, spec: TinySpec) -> dict[str, Any]:
        vision = super().tiny_vision(spec)
        vision.pop("deepstack_visual_indexes")
        return vision

    @classmethod
    def tiny_config(cls, spec: TinySpec, ids: Mapping[str, int]) -> dict[str, Any]:
        config = super().tiny_config(spec, ids)
        text = config["text_config"]
        rotary = int(spec.head_dim * cls.rotary_fraction)
        text["rope_parameters"].update(mrope_section=mrope_section(rotary), partial_rotary_factor=cls.rotary_fraction)
        text.update(layer_types=["linear_attention" if i % 2 == 0 else "full_attention" for i in range(spec.layers)],
                    linear_num_key_heads=spec.heads, linear_num_value_heads=spec.heads,
                    linear_key_head_dim=spec.head_dim, linear_value_head_dim=spec.head_dim, linear_conv_kernel_dim=4)
        return config


def video_patches(frames: Sequence[Image.Image], processor: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel_values (t*gh*gw, C*T*P*P) float32, grid_thw (1, 3) long) of fitted frames.

    Rescaled and normalised as the processor's image path does (float64 rescale cast to float32, then
    float32 ``(x - mean) / std``); frame pairs form temporal patches, rows in merge-block order.
    """
    if not frames:
        raise BadSample("video_empty", "no frames")
    patch = int(processor.patch_size)
    merge = int(processor.merge_size)
    temporal = int(processor.temporal_patch_size)
    if any(f.size != frames[0].size for f in frames):
        raise ValueError(f"video frames differ in size: {sorted({f.size for f in frames})}; fit_video first")
    width, height = frames[0].size
    if height % (patch * merge) or width % (patch * merge):
        raise ValueError(f"frames of {width}x{height} are not on the {patch * merge}-px grid; fit_video first")
    frames = list(frames) + [frames[-1]] * (-len(frames) % temporal)
    array = np.stack([np.asarray(to_rgb(f)) for f in frames])  # (T, H, W, C) uint8
    if processor.do_rescale:
        array = (array.astype(np.float64) * float(processor.rescale_factor)).astype(np.float32)
    array = np.asarray(array, dtype=np.float32)
    if processor.do_normalize:
        mean = np.array(processor.image_mean, dtype=np.float32)
        std = np.array(processor.image_std, dtype=np.float32)
        array = (array - mean) / std
    channels = array.shape[-1]
    grid_t, grid_h, grid_w = len(frames) // temporal, height // patch, width // patch
    blocks = array.transpose(0, 3, 1, 2).reshape(grid_t, temporal, channels, grid_h // merge, merge, patch,
                                                 grid_w // merge, merge, patch)
    # -> (t, block row, block col, row in block, col in block, C, T, patch row, patch col)
    blocks = blocks.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    rows = np.ascontiguousarray(blocks).reshape(grid_t * grid_h * grid_w, channels * temporal * patch * patch)
    return torch.from_numpy(rows), torch.tensor([[grid_t, grid_h, grid_w]], dtype=torch.long)
