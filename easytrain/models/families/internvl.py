"""InternVL (3.x, the transformers-format checkpoints): tiles, pixel shuffle, plain positions.

An image is cut into square tiles of ``vision_config.image_size`` pixels (448
for the published models) on the grid its aspect ratio picks, plus one
thumbnail tile of the whole image when there is more than one; each tile
becomes ``(image_size / patch * downsample_ratio) ** 2`` tokens (256 at 448
px). The chat template writes ``<IMG_CONTEXT>`` once per image; easytrain
expands it to ``<img>`` + one ``<IMG_CONTEXT>`` per token + ``</img>``, as
InternVL's processor does. The language model (Qwen2.5 for InternVL3) takes
plain positions.

In the vision stream a tile is one row of ``pixel_values`` (its ``3 x S x S``
values flattened) and an image's ``image_grid_thw`` row is ``(tiles, 1, 1)``,
so selecting, packing and sharing prompts move an image's tiles as they move
a Qwen image's patch rows.
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping, Sequence

import torch

from easytrain.data.vision import Layout
from easytrain.models.families.base import Family, TinySpec, side
from easytrain.models.families.qwen import text_config
from easytrain.models.families.templates import CHATML_TOKENS, chatml_template

IMAGE_CONTEXT = "<IMG_CONTEXT>"
VIDEO = "<video>"
"""The published tokenizers' video placeholder: vLLM's InternVL processing looks it up, though easytrain sends
InternVL no videos."""

CHAT_TEMPLATE = chatml_template(f"{IMAGE_CONTEXT}\n")

TINY_TILE = 56
"""Tile side of the tiny model: 4 x 4 patches of 14 px, 2 x 2 tokens after the pixel shuffle."""


class InternVL(Family):
    model_types = ("internvl",)
    label = "InternVL (3.x)"
    features = frozenset({"padding_free", "image_dedup", "shared_prompt", "ulysses", "kv_reuse", "vllm"})
    tower_path = "vision_tower"
    projector_paths = ("multi_modal_projector",)
    tiny_tokens: ClassVar[tuple[str, ...]] = CHATML_TOKENS + ("<img>", "</img>", IMAGE_CONTEXT, VIDEO)
    tiny_named_tokens: ClassVar[Mapping[str, str]] = {"start_image_token": "<img>", "end_image_token": "</img>",
                                                      "context_image_token": IMAGE_CONTEXT, "video_token": VIDEO}
    tiny_processor_config: ClassVar[Mapping[str, Any]] = {"processor_class": "InternVLProcessor",
                                                          "image_seq_length": (TINY_TILE // 14 // 2) ** 2}
    tiny_template: ClassVar[str] = CHAT_TEMPLATE
    class_name = "InternVLForConditionalGeneration"
    processor_class_path = "transformers.models.got_ocr2:GotOcr2ImageProcessor"
    """The torchvision backend, transformers' default for InternVL and the one vLLM builds: the thumbnail tile is
    the one resize the processor does itself (easytrain sizes the image on the tile grid), and the PIL backend
    resizes it differently (up to 0.018 in a random image's normalised values, 2e-5 in the tiny model's prompt
    log-probs), so the actor and vLLM share this one."""
    tiny_processor_settings = {"size": {"height": TINY_TILE, "width": TINY_TILE}, "crop_to_patches": True,
                               "image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]}

    @property
    def tile(self) -> int:
        """Tile side in pixels (``vision_config.image_size``)."""
        return side(self.hf_config["vision_config"]["image_size"])

    @property
    def tile_tokens(self) -> int:
        patches = self.tile // side(self.hf_config["vision_config"]["patch_size"])
        return int(round(patches * float(self.hf_config["downsample_ratio"]))) ** 2


    @classmethod
    def tiny_config(cls, spec: TinySpec, ids: Mapping[str, int]) -> dict[str, Any]:
        text = {"model_type": "qwen2", **text_config(spec, ids)}
        vision = {"hidden_size": spec.vision_hidden, "num_hidden_layers": spec.vision_depth,
                  "num_attention_heads": spec.vision_heads, "intermediate_size": spec.vision_intermediate,
                  "image_size": [TINY_TILE, TINY_TILE], "patch_size": [14, 14]}
        return {"model_type": "internvl", "text_config": text, "vision_config": vision, "tie_word_embeddings": True,
                "image_token_id": ids.get(IMAGE_CONTEXT), "downsample_ratio": 0.5,
                "image_seq_length": cls.tiny_processor_config["image_seq_length"]}

    def layout(self, processor: Any = None, tokenizer: Any = None) -> Layout:
        return Layout(factor=self.tile, tokens_per_cell=self.tile_tokens, thumbnail=True, image_pad=IMAGE_CONTEXT,
                      image_open="<img>", image_close="</img>")

    def vllm_prompt_ids(self, ids: list[int]) -> list[int]:
        """Each image's ``<img>`` + context tokens + ``</img>`` (the layout writes it so) back to one context
        token: vLLM's processor writes the run around it, as long as the image (already on the tile grid) takes."""
        context, out = self.hf_config["image_token_id"], []
        for k, t in enumerate(ids):
            if t == context and k > 0 and ids[k - 1] == context:
                continue  # the run's later tokens
            if t == context and out:
                out.pop()  # <img>
            elif k > 0 and ids[k - 1] == context:
                continue  # </img>
            out.append(t)
        return out

    def vllm_processor_kwargs(self, min_pixels: int, max_pixels: int) -> dict[str, Any]:
        """Tiles up to what ``max_pixels`` holds: an image sized on a grid of tiles keeps
        that grid under any larger tile limit (transformers' InternVL grid choice prefers the image's own aspect
        ratio and, at a tie, never a grid of twice its area), and a one-tile image gets no thumbnail."""
        return {"crop_to_patches": True, "min_patches": 1, "max_patches": max(1, max_pixels // self.tile ** 2)}

    def vision_stream(self, processor: Any, images: Sequence[Sequence[Any]], videos: Sequence[Sequence[Any]],
                      order: Sequence[Sequence[int]]) -> dict[str, torch.Tensor]:
        """Each image's tiles from the image processor, called per image with at most the tiles the image's
        size (already on the tile grid) holds, so it picks that grid."""
        if any(videos):
            raise ValueError(f"{self.label} takes no videos in easytrain")
        flat = [im for sample in images for im in sample]
        if not flat:
            return {}
        rows, grids = [], []
        for image in flat:
            cells = (image.height // self.tile) * (image.width // self.tile)
            if cells < 1 or image.height % self.tile or image.width % self.tile:
                raise ValueError(f"an image of {image.width}x{image.height} px is not on the {self.tile}-px tile "
                                 "grid; the dataset sizes images with the family's layout first")
            out = processor(images=[image], return_tensors="pt", crop_to_patches=cells > 1, min_patches=1,
                            max_patches=cells)
            tiles = out["pixel_values"]
            expected = cells + int(cells > 1)
            if tiles.shape[0] != expected:
                raise ValueError(f"the image processor cut a {image.width}x{image.height} image into "
                                 f"{tiles.shape[0]} tiles, the layout counted {expected}")
            rows.append(tiles.reshape(tiles.shape[0], -1))
            grids.append(torch.tensor([tiles.shape[0], 1, 1]))
        return {"pixel_values": torch.cat(rows).float(), "image_grid_thw": torch.stack(grids),
                "visual_seconds": torch.zeros(len(grids), dtype=torch.float32)}

    def visual_kwargs(self, tensors: Mapping[str, torch.Tensor], seconds_arg: bool = False) -> dict[str, torch.Tensor]:
        if "pixel_values" not in tensors:
            return {}
        return {"pixel_values": tensors["pixel_values"].reshape(-1, 3, self.tile, self.tile)}

    def visual_tokens(self, grid: torch.Tensor) -> list[int]:
        return [int(n) * self.tile_tokens for n in grid[:, 0].tolist()]

    def patch_geometry(self) -> tuple[int, int, int]:
        patch = super().patch_geometry()[0]
        return patch, round(1 / float(self.hf_config["downsample_ratio"])), 1

