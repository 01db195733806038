"""Parameter counts by component from the HF config alone (meta device), against real models."""

from __future__ import annotations

from typing import Any

import pytest

from easytrain.memory.params import component_of, count_parameters
from easytrain.models.tiny import model_class_for, tiny_hf_config

from conftest import tiny_families
from published import PUBLISHED


@pytest.mark.parametrize("family", tiny_families())
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
def test_known_model_shapes_count_their_published_sizes() -> None:
    """conf/model/ holds the shape settings of the public configs; built on the meta device they have
    the exact parameter counts the Hub publishes (tests/published.py), so the settings are the real ones."""
    from easytrain.memory.params import count_parameters
    from easytrain.config.presets import known_hf_configs

    known = known_hf_configs()
    assert set(known) == set(PUBLISHED)
    for hub_id, published in PUBLISHED.items():
        total = count_parameters(known[hub_id]).total
        assert total == published, (hub_id, total, published)  # exact (the issue asks for 0.1%)
    seven = count_parameters(known["Qwen/Qwen2.5-VL-7B-Instruct"])
    assert seven.embeddings == seven.lm_head == 152064 * 3584  # untied head: vocab x hidden each
    assert seven.total == 8_292_166_656


@pytest.mark.parametrize("name,component", [
    ("model.visual.merger.linear_fc1.weight", "projector"),  # Qwen2.5-VL / Qwen3-VL
    ("model.visual.deepstack_merger_list.0.linear_fc1.weight", "projector"),  # Qwen3-VL's DeepStack mergers
    ("model.visual.blocks.3.attn.qkv.weight", "vision_tower"),
    ("model.visual.pos_embed.weight", "vision_tower"),
    ("model.vision_tower.encoder.layer.0.attention.q_proj.weight", "vision_tower"),  # InternVL
    ("model.vision_tower.encoder.layers.0.mlp.fc1.weight", "vision_tower"),  # Gemma 3's SigLIP
    ("model.multi_modal_projector.linear_1.weight", "projector"),  # InternVL
    ("model.multi_modal_projector.mm_input_projection_weight", "projector"),  # Gemma 3
    ("model.language_model.embed_tokens.weight", "embeddings"),
    ("model.language_model.layers.0.mlp.experts.gate_up_proj", "language_model"),
    ("lm_head.weight", "lm_head"),
])
def test_components_of_the_new_families(name: str, component: str) -> None:
    assert component_of(name) == component


@pytest.mark.slow
def test_new_families_count_by_component() -> None:
    """Qwen3-VL, InternVL and Gemma 3 split into tower, projector, embeddings, blocks and head as they should:
    the tied heads count zero, the untied ones vocab x hidden, and the projectors their published shapes."""
    from easytrain.config.presets import known_hf_configs

    known = known_hf_configs()
    eight = count_parameters(known["Qwen/Qwen3-VL-8B-Instruct"])
    assert eight.embeddings == eight.lm_head == 151_936 * 4096
    # merger + 3 DeepStack mergers, each: LayerNorm(4608) (the 1152-wide merger norms before the 2x2 merge), 4608x4608
    # and 4608x4096 with biases
    assert eight.projector == 1152 * 2 + 3 * 4608 * 2 + 4 * (4608 * 4608 + 4608 + 4608 * 4096 + 4096)
    two = count_parameters(known["Qwen/Qwen3-VL-2B-Instruct"])
    assert two.lm_head == 0 and two.embeddings == 151_936 * 2048  # tied
    internvl = count_parameters(known["OpenGVLab/InternVL3-8B-hf"])
    # LayerNorm(4 x 1024) after the pixel shuffle, 4096 -> 3584 -> 3584 with biases
    assert internvl.projector == 2 * 4096 + 4096 * 3584 + 3584 + 3584 * 3584 + 3584
    assert internvl.embeddings == internvl.lm_head == 151_674 * 3584
    gemma = count_parameters(known["google/gemma-3-4b-it"])
    assert gemma.projector == 1152 * 2560 + 1152 and gemma.lm_head == 0  # projection and its RMSNorm; tied head
    assert gemma.vision_tower == 416_866_032  # SigLIP so400m at 896 px, without its pooling head
    assert all(count.experts == count.active_experts == 0 and count.active == count.total
               for count in (eight, two, internvl, gemma))


@pytest.mark.slow
def test_mixture_of_experts_counts_total_and_active_parameters() -> None:
    """Qwen3-VL-30B-A3B: 48 layers of 128 experts (gate, up and down: 3 x 2048 x 768 each), 8 of them per token;
    everything else (attention, router, norms, embeddings, head, vision) every token uses."""
    from easytrain.config.presets import known_hf_configs
    from easytrain.memory.activations import model_dims, shard_units

    hf = known_hf_configs()["Qwen/Qwen3-VL-30B-A3B-Instruct"]
    counts = count_parameters(hf)
    expert = 3 * 2048 * 768
    assert counts.experts == 48 * 128 * expert
    assert counts.active_experts == 48 * 8 * expert
    assert counts.active == counts.total - 48 * 120 * expert == 3_891_664_112
    assert counts.total == 31_070_754_032
    assert model_dims(hf).intermediate == 8 * 768  # a token's MLP: the 8 experts it is routed to
    assert shard_units(hf)[1] >= 128 * expert  # an FSDP unit gathers a block with all its experts


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
