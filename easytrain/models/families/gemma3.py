"""Gemma 3: one fixed-size image, SigLIP tower, pooled to a fixed token count, bidirectional image attention.

Every image is resized to ``vision_config.image_size`` square (896 px for the
published models; no pan-and-scan crops) and becomes ``mm_tokens_per_image``
tokens (256): the SigLIP tower's patches average-pooled. The chat template
writes ``<start_of_image>`` once per image; easytrain expands it as Gemma's
processor does, to ``\\n\\n<start_of_image>`` + one ``<image_soft_token>`` per
token + ``<end_of_image>\\n\\n``. Positions are plain. The tokens of one image
attend to each other both ways (``token_type_ids``), which the padded passes
give the model; the padding-free and prompt-sharing passes build causal
masks, so they are off for this family.

In the vision stream an image is one row of ``pixel_values`` (its ``3 x S x
S`` values) with ``image_grid_thw`` ``(1, 1, 1)``: the generic adapter's
fixed-size path (:class:`~easytrain.models.families.base.FixedImage`), which
this adapter shares, adding its placeholder expansion and ``token_type_ids``.
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

import torch

from easytrain.data.vision import MM_IMAGE, Layout
from easytrain.models.families.base import Family, TinySpec
from easytrain.models.families.templates import CHATML_TOKENS, chatml_template

BOI, EOI, SOFT = "<start_of_image>", "<end_of_image>", "<image_soft_token>"

CHAT_TEMPLATE = chatml_template(BOI, system=False)
"""ChatML turns (the tiny tokenizer's) with Gemma's image placeholder."""

TINY_IMAGE = 112
"""Image side of the tiny model: 8 x 8 patches of 14 px, pooled 2 x 2 into 16 tokens."""


class Gemma3(Family):
    model_types = ("gemma3",)
    label = "Gemma 3"
    features = frozenset({"image_dedup", "kv_reuse"})
    tower_path = "vision_tower"
    projector_paths = ("multi_modal_projector",)
    unsupported_why: ClassVar[Mapping[str, str]] = {
        "vllm": "not built (vLLM 0.32 re-merges the newline tokens around each image, and only its GPU "
                "flash-attention backend gives an image's tokens their two-way attention, not checked against the "
                "actor here); use worker.rollout.engine=hf"}
    tiny_tokens: ClassVar[tuple[str, ...]] = CHATML_TOKENS + (BOI, EOI, SOFT)
    tiny_template: ClassVar[str] = CHAT_TEMPLATE
    tiny_named_tokens: ClassVar[Mapping[str, str]] = {"boi_token": BOI, "eoi_token": EOI, "image_token": SOFT}
    tiny_processor_config: ClassVar[Mapping[str, Any]] = {"processor_class": "Gemma3Processor",
                                                          "image_seq_length": (TINY_IMAGE // 14 // 2) ** 2}
    class_name = "Gemma3ForConditionalGeneration"
    qk_norm = True
    sandwich_norm = True
    placeholder_names = ("image_token_id", "boi_token_id", "eoi_token_id")
    processor_class_path = "transformers.models.gemma3:Gemma3ImageProcessorPil"
    tiny_processor_settings = {"size": {"height": TINY_IMAGE, "width": TINY_IMAGE}, "do_pan_and_scan": False}
    image_tokens_keys = ("mm_tokens_per_image",)
    image_token_keys = ("image_token_index", "image_token_id")
    image_call = {"do_pan_and_scan": False}

    @classmethod
    def tiny_config(cls, spec: TinySpec, ids: Mapping[str, int]) -> dict[str, Any]:
        text = {"model_type": "gemma3_text", "vocab_size": spec.vocab, "hidden_size": spec.hidden,
                "intermediate_size": spec.intermediate, "num_hidden_layers": spec.layers,
                "num_attention_heads": spec.heads, "num_key_value_heads": spec.kv_heads, "head_dim": spec.head_dim,
                "query_pre_attn_scalar": spec.head_dim, "sliding_window": 512, "max_position_embeddings": 4096,
                "layer_types": ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(spec.layers)],
                "bos_token_id": ids.get("<|endoftext|>"), "eos_token_id": ids.get("<|im_end|>"),
                "pad_token_id": ids.get("<|endoftext|>")}
        vision = {"model_type": "siglip_vision_model", "hidden_size": spec.vision_hidden,
                  "intermediate_size": spec.vision_intermediate, "num_hidden_layers": spec.vision_depth,
                  "num_attention_heads": spec.vision_heads, "image_size": TINY_IMAGE, "patch_size": 14,
                  "vision_use_head": False}
        return {"model_type": "gemma3", "text_config": text, "vision_config": vision, "tie_word_embeddings": True,
                "mm_tokens_per_image": cls.tiny_processor_config["image_seq_length"],
                "boi_token_index": ids.get(BOI), "eoi_token_index": ids.get(EOI), "image_token_index": ids.get(SOFT)}

    def layout(self, processor: Any = None, tokenizer: Any = None) -> Layout:
        image = self._fixed()
        return Layout(factor=image.side, tokens_per_cell=image.tokens, fixed_size=True, image_pad=BOI,
                      image_fill=SOFT, image_open=f"\n\n{BOI}", image_close=f"{EOI}\n\n")

    def model_kwargs(self, tensors: Mapping[str, torch.Tensor], seconds_arg: bool = False) -> dict[str, torch.Tensor]:
        """The images, and ``token_type_ids`` (1 at image tokens): each image's tokens attend to each other."""
        out = self.visual_kwargs(tensors, seconds_arg)
        if "mm_token_type_ids" in tensors:
            out["token_type_ids"] = (tensors["mm_token_type_ids"] == MM_IMAGE).long()
        return out

