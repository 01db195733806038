"""Which parts of a model train: frozen towers and LoRA adapters, shared by the workers that build models and
the planner that counts their parameters (on a meta copy)."""

from __future__ import annotations

from typing import Any

from torch import nn

LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def apply_lora(model: nn.Module, lora: Any) -> nn.Module:
    """PEFT LoRA adapters on the language model; everything else frozen.

    ``all-linear`` means the language model's attention and MLP projections
    (the vision tower and the head are left out, as is usual for VLM LoRA).
    """
    from peft import LoraConfig, get_peft_model

    if list(lora.target_modules) == ["all-linear"]:
        scope = r".*language_model\." if hasattr(getattr(model, "model", model), "language_model") else r".*layers\."
        targets: Any = scope + r".*\.(" + "|".join(LINEAR_NAMES) + r")$"
    else:
        targets = list(lora.target_modules)
    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets,
                        bias="none")
    return get_peft_model(model, config)


def freeze_parts(model: nn.Module, vision: bool, aligner: bool, llm: bool) -> None:
    """Turn off gradients of the vision tower, the projector (merger) and/or the language model."""
    inner: Any = getattr(model, "model", model)
    visual = getattr(inner, "visual", None)
    if visual is not None:
        for name, param in visual.named_parameters():
            is_merger = name.startswith("merger.")
            if (is_merger and aligner) or (not is_merger and vision):
                param.requires_grad_(False)
    if llm:
        language = getattr(inner, "language_model", inner if visual is None else None)
        if language is not None:
            language.requires_grad_(False)
        if hasattr(model, "lm_head") and not getattr(model.config, "tie_word_embeddings", False):
            model.lm_head.requires_grad_(False)
