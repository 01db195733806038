"""Which parts of a model train: frozen towers and LoRA adapters, shared by the workers that build models and
the planner that counts their parameters (on a meta copy)."""

from __future__ import annotations

from typing import Any

from torch import nn

from easytrain.models.families import family_of

LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def apply_lora(model: nn.Module, lora: Any) -> nn.Module:
    """PEFT LoRA adapters on the language model; everything else frozen.

    ``all-linear`` means the language model's attention and MLP projections
    (the vision tower and the head are left out, as is usual for VLM LoRA).
    """
    from peft import LoraConfig, get_peft_model

    if list(lora.target_modules) == ["all-linear"]:
        targets: Any = family_of(model).lora_scope(model) + r".*\.(" + "|".join(LINEAR_NAMES) + r")$"
    else:
        targets = list(lora.target_modules)
    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets,
                        bias="none")
    return get_peft_model(model, config)


def freeze_parts(model: nn.Module, vision: bool, aligner: bool, llm: bool) -> None:
    """Turn off gradients of the vision tower, the projector and/or the language model (where the model's family
    adapter says they are)."""
    family_of(model).freeze(model, vision, aligner, llm)
