"""``model.path=random:<name>``: conf/model's real shapes with random weights, the tiny tokenizer, no download."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from PIL import Image

from easytrain.config import ConfigError, compose, load, to_config, with_default_preset
from easytrain.config.schema import ModelConfig
from easytrain.config import presets
from easytrain.models import shapes
from easytrain.models.hf import load_image_processor, load_model, load_tokenizer, model_folder
from easytrain.models.random_init import MARKER, is_random_folder
from easytrain.models.tiny import VOCAB_SIZE, model_class_for, tiny_hf_config

from published import PUBLISHED

NAMES = sorted(path.stem for path in presets.MODEL_CONF_DIR.glob("*.yaml"))


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("easytrain-cache"))


@pytest.fixture
def small_vl_preset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A conf/model/ holding one small Qwen2.5-VL shape (``random:small_vl``), so the vision path runs in seconds."""
    shape = tiny_hf_config("qwen2_5_vl", "small")
    shape = {k: v for k, v in shape.items() if not k.endswith("_token_id")}
    shape["text_config"] = {k: v for k, v in shape["text_config"].items() if not k.endswith("_token_id")}
    shape["text_config"]["vocab_size"] = 2048  # larger than the tokenizer's, as Qwen's is
    (tmp_path / "small_vl.yaml").write_text(yaml.safe_dump({"hub_id": "test/small-vl", "hf_config": shape}))
    monkeypatch.setattr(presets, "MODEL_CONF_DIR", tmp_path)
    return "random:small_vl"


def _model_config(path: str, cache: str, *extra: str) -> ModelConfig:
    return load([f"model.path={path}", f"model.cache_dir={cache}", *extra]).model


@pytest.mark.parametrize("name", NAMES)
def test_every_preset_has_its_published_parameter_count(name: str, cache: str) -> None:
    """What a rank other than 0 builds (the folder's config on the meta device) is the published model's size."""
    from easytrain.distributed.load import meta_model
    from easytrain.models.families import TINY_FAMILIES, adapter_class, family_of

    config = _model_config(f"random:{name}", cache)
    model_type = presets.model_presets()[name]["hf_config"]["model_type"]
    if adapter_class(model_type).tiny_family() not in TINY_FAMILIES:  # no tiny tokenizer to pair: a clear error
        with pytest.raises(ConfigError, match=rf"model.path='random:{name}': no tiny tokenizer of its family"):
            model_folder(config)
        return
    folder = model_folder(config)
    assert is_random_folder(folder) and not list(Path(folder).glob("*.safetensors"))
    model = meta_model(config, folder)
    hub_id = yaml.safe_load((presets.MODEL_CONF_DIR / f"{name}.yaml").read_text())["hub_id"]
    published = PUBLISHED[hub_id]
    assert abs(sum(p.numel() for p in model.parameters()) - published) <= 1e-3 * published
    text = model.config.get_text_config()
    assert text.vocab_size > VOCAB_SIZE  # the model's vocabulary exceeds the tiny tokenizer's
    family = family_of(model)
    tokens = adapter_class(family.tiny_family()).tiny_tokens
    ids = {tok: load_tokenizer(config, folder).convert_tokens_to_ids(tok) for tok in tokens}
    assert text.eos_token_id == model.generation_config.eos_token_id == ids["<|im_end|>"]
    if family.vision:
        processor = load_image_processor(config, folder)
        assert processor is not None
        layout = family.layout(processor)
        assert layout is not None and model.config.image_token_id == ids[layout.image_token]


def test_shape_and_planner_config_are_the_named_models() -> None:
    for name in NAMES:
        hub_id = presets.model_presets()[name]["hub_id"]
        random_cfg, named = ModelConfig(path=f"random:{name}"), ModelConfig(path=hub_id)
        assert shapes.hf_config_for(random_cfg) == shapes.hf_config_for(named)
        assert shapes.resolve_shape(random_cfg) == shapes.resolve_shape(named)


def test_materialised_half_billion_model_is_initialised_and_runs(cache: str) -> None:
    """Qwen2.5-0.5B in bfloat16 on CPU: transformers' init everywhere, rotary buffers as the normal constructor
    computes them (a whole normal build is compared in the vision test), tied head."""
    config = _model_config("random:qwen25_0_5b", cache, "model.dtype=bfloat16")
    folder = model_folder(config)
    model = load_model(config, folder)
    assert model.dtype == torch.bfloat16 and not model.training
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied after to_empty
    assert not any(p.is_meta for p in model.parameters())
    std = model.config.initializer_range
    for name, param in model.named_parameters():
        values = param.detach()
        assert torch.isfinite(values.sum(dtype=torch.float32)), name  # a NaN or inf anywhere shows in the sum
        if values.dim() == 2:  # projections and embeddings: normal(0, initializer_range); 512 rows tell
            assert abs(float(values[:512].float().std()) - std) < 0.1 * std, name
        elif name.endswith("norm.weight"):
            assert bool((values == 1).all()), name
        else:  # q/k/v biases
            assert bool((values == 0).all()), name
    rotary = model.model.rotary_emb  # the only buffers: as the normal constructor computes them
    normal = type(rotary)(model.config)
    assert [n for n, _ in model.named_buffers()] == ["model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"]
    assert torch.equal(rotary.inv_freq, normal.inv_freq) and torch.equal(rotary.original_inv_freq, normal.inv_freq)

    tokenizer = load_tokenizer(config, folder)
    ids = tokenizer("How many circles are there?", return_tensors="pt").input_ids
    assert tokenizer.decode(ids[0]) == "How many circles are there?"
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], 151936) and torch.isfinite(logits).all()


def test_vision_model_initialises_buffers_and_takes_images(small_vl_preset: str, cache: str) -> None:
    """A random: VL model: rotary buffers (text and vision) equal a normal build's, an image goes through, the
    seed decides the weights, and the meta copy other ranks build has the same parameters."""
    from easytrain.data.vision import expand_image_placeholders, image_token_counts, mm_token_type_ids
    from easytrain.distributed.load import meta_model

    config = _model_config(small_vl_preset, cache)
    folder = model_folder(config)
    assert json.loads((Path(folder) / MARKER).read_text())["name"] == "small_vl"
    model = load_model(config, folder)
    assert model.lm_head.weight is model.model.language_model.embed_tokens.weight  # tie_word_embeddings: true
    for name, param in model.named_parameters():
        assert torch.isfinite(param.detach()).all(), name
        if param.dim() == 2 and "norm" not in name:
            assert abs(float(param.detach().std()) - 0.02) < 0.002, name
    normal = model_class_for("qwen2_5_vl")._from_config(model.config, dtype=torch.float32)
    expected = dict(normal.named_buffers())
    assert {n for n in expected if "inv_freq" in n} >= {"model.language_model.rotary_emb.inv_freq",
                                                       "model.visual.rotary_pos_emb.inv_freq"}
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, expected[name]), name
    meta = meta_model(config, folder)
    assert [(n, p.shape) for n, p in meta.named_parameters()] == [(n, p.shape) for n, p in model.named_parameters()]

    tokenizer, processor = load_tokenizer(config, folder), load_image_processor(config, folder)
    content = [{"type": "image"}, {"type": "text", "text": "What colour is the circle?"}]
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    vision = dict(processor(images=[Image.new("RGB", (56, 84), (200, 30, 30))], return_tensors="pt"))
    text = expand_image_placeholders(text, image_token_counts(vision["image_grid_thw"], processor.merge_size))
    batch: dict[str, Any] = dict(tokenizer([text], return_tensors="pt"))
    batch["mm_token_type_ids"] = mm_token_type_ids(batch["input_ids"], model.config.image_token_id)
    with torch.no_grad():
        logits = model(**batch, **vision).logits
    assert logits.shape[-1] == 2048 and torch.isfinite(logits).all()

    again = load_model(config, folder)
    other = load_model(_model_config(small_vl_preset, cache, "model.tiny_seed=1"))
    first = model.model.language_model.layers[0].self_attn.q_proj.weight
    assert torch.equal(first, again.model.language_model.layers[0].self_attn.q_proj.weight)
    assert not torch.equal(first, other.model.language_model.layers[0].self_attn.q_proj.weight)


def _plan(overrides: list[str]) -> dict[str, Any]:
    from easytrain.memory.report import plan_command

    return json.loads(plan_command(to_config(compose(with_default_preset(overrides))), "json", False))


def test_plan_of_random_7b_is_the_named_models_plan() -> None:
    named = _plan(["+exp=qwen25vl_7b"])
    randomised = _plan(["model.path=random:qwen25vl_7b", "+exp=qwen25vl_7b"])
    assert randomised.pop("model") == "random:qwen25vl_7b" and named.pop("model") == "Qwen/Qwen2.5-VL-7B-Instruct"
    # one difference: a GPU engine loading the named checkpoint passes its bf16 weights through host RAM
    # (measured on an H200); a random engine is built on its device
    load_named, load_random = named["once"][0], randomised["once"][0]
    assert load_named["phase"] == load_random["phase"] == "load"
    assert load_named["host_bytes"] - load_random["host_bytes"] == 8_292_166_656 * 2
    named["once"][0] = randomised["once"][0] = {}
    for report in (named, randomised):
        report.pop("host_peak_bytes", None)
    assert randomised == named


def test_unknown_name_is_a_config_error_listing_the_names() -> None:
    with pytest.raises(ConfigError) as info:
        load(["model.path=random:qwen25vl_9b"])
    message = str(info.value)
    assert message.startswith("model.path='random:qwen25vl_9b'") and "\n" not in message
    assert all(f"random:{name}" in message for name in NAMES)


def test_vllm_reads_no_weights_from_a_random_folder(cache: str) -> None:
    from easytrain.workers.rollout.engine import EngineSpec
    from easytrain.workers.rollout.vllm_engine import engine_kwargs

    config = load(["model.path=random:qwen25_0_5b", f"model.cache_dir={cache}"])
    spec = EngineSpec(folder=Path(model_folder(config.model)), stop_ids=[2], pad_id=0, device=torch.device("cpu"))
    assert engine_kwargs(config, spec)["load_format"] == "dummy"
    tiny = load([f"model.cache_dir={cache}"])
    spec = EngineSpec(folder=Path(model_folder(tiny.model)), stop_ids=[2], pad_id=0, device=torch.device("cpu"))
    assert "load_format" not in engine_kwargs(tiny, spec)
