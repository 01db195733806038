"""Parameter counts by component from the HF config alone (meta device), against real models."""

from __future__ import annotations

from typing import Any

import pytest

from easytrain.memory.params import component_of, count_parameters
from easytrain.models.tiny import model_class_for, tiny_hf_config


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_vl", "qwen2"])
@pytest.mark.parametrize("size", ["tiny", "small"])
def test_counts_equal_the_real_models_by_component(tiny_model: Any, family: str, size: str) -> None:
    counted = count_parameters(tiny_hf_config(family, size))
    model = model_class_for(family).from_pretrained(tiny_model(family, size))
    real: dict[str, int] = {}
    for name, parameter in model.named_parameters():
        real[component_of(name)] = real.get(component_of(name), 0) + parameter.numel()
    assert {k: v for k, v in counted.as_dict().items() if v} == real
    assert counted.total == sum(p.numel() for p in model.parameters())
    assert (counted.vision_tower > 0) == (family != "qwen2") and counted.lm_head == 0  # tiny models tie


@pytest.mark.slow
def test_qwen25_vl_7b_counts_its_published_size() -> None:
    """Qwen2.5-VL-7B-Instruct (text and vision settings of its public config.json): 8.29B parameters as
    published; the embeddings and the untied LM head are vocab x hidden each."""
    config = {"model_type": "qwen2_5_vl", "tie_word_embeddings": False,
              "text_config": {"vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
                              "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                              "max_position_embeddings": 128000},
              "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                                "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2,
                                "temporal_patch_size": 2, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31]}}
    counts = count_parameters(config)
    assert counts.embeddings == counts.lm_head == 152064 * 3584
    assert round(counts.total / 1e9, 2) == 8.29
