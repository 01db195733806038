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


PUBLISHED_BILLIONS = {  # the parameter counts the model cards publish
    "Qwen/Qwen2.5-VL-3B-Instruct": "3.75", "Qwen/Qwen2.5-VL-7B-Instruct": "8.29",
    "Qwen/Qwen2.5-VL-32B-Instruct": "33.5", "Qwen/Qwen2.5-VL-72B-Instruct": "73.4",
    "Qwen/Qwen2-VL-2B-Instruct": "2.21", "Qwen/Qwen2-VL-7B-Instruct": "8.29", "Qwen/Qwen2-VL-72B-Instruct": "73.4",
    "Qwen/Qwen2.5-7B-Instruct": "7.62",
    "Qwen/Qwen2.5-1.5B-Instruct": "1.54", "Qwen/Qwen2.5-0.5B-Instruct": "0.49",
}


@pytest.mark.slow
def test_known_model_shapes_count_their_published_sizes() -> None:
    """conf/model/ holds the shape settings of the public configs; built on the meta device they have
    the published parameter counts (to the published precision), so the settings are the real ones."""
    from easytrain.memory.params import count_parameters
    from easytrain.config.presets import known_hf_configs

    known = known_hf_configs()
    assert set(known) == set(PUBLISHED_BILLIONS)
    for hub_id, published in PUBLISHED_BILLIONS.items():
        total = count_parameters(known[hub_id]).total / 1e9
        decimals = len(published.split(".")[1])
        assert f"{total:.{decimals}f}" == published, (hub_id, total)
    seven = count_parameters(known["Qwen/Qwen2.5-VL-7B-Instruct"])
    assert seven.embeddings == seven.lm_head == 152064 * 3584  # untied head: vocab x hidden each
    assert seven.total == 8_292_166_656


def test_hf_config_for_reads_tiny_local_and_known_models(tiny_model: Any) -> None:
    from easytrain.config import load
    from easytrain.models.shapes import hf_config_for

    assert hf_config_for(load([]).model)["model_type"] == "qwen2_5_vl"  # the tiny preset
    local = hf_config_for(load([f"model.path={tiny_model('qwen2')}"]).model)
    assert local is not None and local["model_type"] == "qwen2"
    known = hf_config_for(load(["+exp=qwen25vl_7b"]).model)
    assert known is not None and known["text_config"]["hidden_size"] == 3584


@pytest.mark.parametrize("extra", [[], ["model.freeze_vision_tower=true"], ["model.freeze_aligner=true"],
                                   ["model.lora.rank=4", "model.lora.target_modules=[all-linear]"],
                                   ["model.lora.rank=8", "model.lora.target_modules=[q_proj,v_proj]"]])
def test_trainable_counts_follow_the_actors_own_set_up(tiny_model: Any, extra: list[str]) -> None:
    """The meta model goes through the same freeze_parts/apply_lora as the actor's real one."""
    from easytrain.config import load
    from easytrain.memory.params import trainable_parameters
    from easytrain.models.parts import apply_lora, freeze_parts

    config = load(["model.tiny_size=small", *extra]).model
    model = model_class_for("qwen2_5_vl").from_pretrained(tiny_model("qwen2_5_vl", "small"))
    freeze_parts(model, config.freeze_vision_tower, config.freeze_aligner, config.freeze_llm)
    if config.lora.rank:
        model = apply_lora(model, config.lora)
    real = (sum(p.numel() for p in model.parameters() if p.requires_grad), sum(p.numel() for p in model.parameters()))
    assert trainable_parameters(tiny_hf_config("qwen2_5_vl", "small"), config) == real


def test_state_bytes_of_a_7b_model_under_fsdp_8() -> None:
    """Hand-computed: 8,292,166,656 parameters (Qwen2.5-VL-7B), fp32 master weights sharded over 8 GPUs
    = 1,036,520,832 each x 4 bytes; fp32 gradients the same; AdamW's two fp32 moments twice that."""
    from easytrain.memory.states import role_states, shard_degree

    n = 8_292_166_656
    actor = role_states(n, n, shard_degree(-1, 8), trains=True, offload_params=False)
    assert (actor.params, actor.grads, actor.optimizer) == (4_146_083_328, 4_146_083_328, 8_292_166_656)
    assert actor.device == 16_584_333_312 and actor.host == 0
    offloaded = role_states(n, n, 8, trains=True, offload_params=True)
    assert offloaded.device == 0 and offloaded.host == 16_584_333_312
    reference = role_states(n, n, 8, trains=False, offload_params=False)
    assert reference.device == 4_146_083_328 and reference.grads == reference.optimizer == 0
    frozen_vision = role_states(n, n - 631_975_680, 8, trains=True, offload_params=False)  # tower frozen
    assert frozen_vision.grads == 3_830_095_488 and frozen_vision.optimizer == 7_660_190_976
    hybrid = role_states(n, n, shard_degree(4, 8), trains=False, offload_params=False)  # 2 replicas of 4 shards
    assert hybrid.params == 8_292_166_656
