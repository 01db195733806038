"""Images for a family without an adapter of its own, through the generic adapter: a tiny LLaVA-1.5 (built here
from real transformers classes: a CLIP tower, a Qwen2 language model) follows transformers' common fixed-size
interface, so the data pipeline sizes its images and writes its ``<image>`` tokens from the config alone; its
forward through easytrain's collation equals transformers' own processor and forward; GRPO and SFT run end to end
with the features that need family knowledge off; those features are one-line config errors; and a vision model
whose config lacks the fixed-size interface keeps the config error for images."""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from easytrain.config import ConfigError, compose, with_default_preset
from easytrain.main import resolve
from easytrain.models.families import Family, family_of
from easytrain.models.families.base import STAND_IN_IMAGE, Bound
from easytrain.models.families.qwen import text_config
from easytrain.models.families.templates import CHATML_TOKENS, chatml_template
from easytrain.models.hf import load_model
from easytrain.models.tiny import SPECS, build_tokenizer
from easytrain.trainer.data import RLData

from rl_batches import rl_config

ROOT = Path(__file__).resolve().parents[1]
IMAGE = "<image>"
SIDE, PATCH = 56, 14
TOKENS = (SIDE // PATCH) ** 2
"""Vision tokens per image: CLIP's 4 x 4 patches (its class token dropped by the ``default`` feature strategy)."""
GENERIC = "any other transformers model (generic) (llava)"


def build_llava(folder: Path, seed: int = 0) -> Path:
    """A tiny random LLaVA-1.5 saved with ``save_pretrained``: config and weights, a byte-level BPE tokenizer with
    ChatML turns and an ``<image>`` special token (the chat template writes it for an image part), and a CLIP
    image processor (loads with the PIL backend)."""
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration, Qwen2Config
    from transformers.models.clip import CLIPImageProcessorPil

    specials = CHATML_TOKENS + (IMAGE,)
    tokenizer = build_tokenizer(seed, special_tokens=specials, chat_template=chatml_template(IMAGE))
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in specials}
    spec = SPECS["tiny"]
    vision = CLIPVisionConfig(hidden_size=spec.vision_hidden, intermediate_size=spec.vision_intermediate,
                              num_hidden_layers=spec.vision_depth, num_attention_heads=spec.vision_heads,
                              image_size=SIDE, patch_size=PATCH)
    config = LlavaConfig(vision_config=vision, text_config=Qwen2Config(**text_config(spec, ids)),
                         image_token_index=ids[IMAGE], image_seq_length=TOKENS, vision_feature_layer=-1,
                         vision_feature_select_strategy="default", tie_word_embeddings=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlavaForConditionalGeneration(config).to(torch.float32)
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    CLIPImageProcessorPil(size={"shortest_edge": SIDE}, crop_size={"height": SIDE, "width": SIDE}).save_pretrained(
        folder)
    return folder


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_llava(tmp_path_factory.mktemp("llava") / "tiny-llava")


def config_json(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "config.json").read_text())


def test_the_generic_adapter_reads_the_fixed_image_interface_from_the_config(llava: Path) -> None:
    from transformers import AutoTokenizer

    from easytrain.memory.vision import vision_geometry

    family = family_of(config_json(llava))
    assert type(family) is Family and family.features == frozenset()
    tokenizer = AutoTokenizer.from_pretrained(str(llava))
    layout = family.layout(None, tokenizer)
    assert layout is not None and layout.fixed_size and (layout.factor, layout.tokens_per_cell) == (SIDE, TOKENS)
    assert layout.image_pad == layout.image_token == IMAGE and not layout.image_open and not layout.image_fill
    assert family.layout().image_pad == STAND_IN_IMAGE  # no tokenizer (planning, config checks): the geometry only
    bound = Bound.of(family, family.image_processor(str(llava)), tokenizer)
    assert bound.image_token_id == tokenizer.convert_tokens_to_ids(IMAGE) == family.hf_config["image_token_index"]
    assert bound.video_token_id == -1
    geometry = vision_geometry(config_json(llava))  # the planner: one fixed image of 16 tokens, a patch a token
    assert geometry is not None and geometry.image_tokens(10**9) == TOKENS and geometry.merge == 1
    assert (geometry.cell, geometry.patch, geometry.fixed_cells) == (SIDE, PATCH, 1)


def test_image_tokens_equal_the_features_and_the_forward_equals_transformers_own(llava: Path,
                                                                                 tmp_path: Path) -> None:
    """The prompts' ``<image>`` runs are as long as the tower's features per image, and the logits of the
    collated (left-padded) batch equal, token for token, LLaVA's own processor and forward on each prompt."""
    from transformers import LlavaProcessor

    data = RLData(rl_config(tmp_path, f"model.path={llava}"))
    prompts = [data.train[i] for i in range(4)]
    batch = data.collator(prompts)
    model = load_model(data.config.model, str(llava)).eval()
    family = family_of(model)
    image_id = int(model.config.image_token_id)
    kwargs = family.model_kwargs(batch)
    assert kwargs.keys() == {"pixel_values"} and kwargs["pixel_values"].shape == (4, 3, SIDE, SIDE)
    with torch.no_grad():
        features = model.model.get_image_features(pixel_values=kwargs["pixel_values"]).pooler_output
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"], **kwargs).logits
    per_image = [len(f) for f in features] if isinstance(features, (list, tuple)) else [features.shape[1]] * 4
    counts = [int(n) for n in (batch["input_ids"] == image_id).sum(-1)]
    assert counts == per_image == family.visual_tokens(batch["image_grid_thw"]) == [TOKENS] * 4
    assert int(family.visual_rows(batch["image_grid_thw"]).sum()) == batch["pixel_values"].shape[0] == 4

    processor = LlavaProcessor(image_processor=data.processor, tokenizer=data.tokenizer, patch_size=PATCH,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               image_token=IMAGE)
    for row, prompt in enumerate(prompts):
        own = processor(images=prompt.images, text=prompt.vllm_text, return_tensors="pt")
        keep = batch["attention_mask"][row].bool()
        assert own["input_ids"][0].tolist() == batch["input_ids"][row][keep].tolist() == prompt.input_ids
        with torch.no_grad():
            want = model(**own).logits[0]
        # float32 sums over a hidden width of 64: the padded batch's kernels may round in another order
        torch.testing.assert_close(logits[row][keep], want, rtol=1e-5, atol=1e-5)


def test_freezes_and_lora_find_the_common_module_names(llava: Path, tmp_path: Path) -> None:
    from easytrain.models.parts import apply_lora, freeze_parts

    config = rl_config(tmp_path, f"model.path={llava}", "model.lora.rank=4", "model.lora.target_modules=[all-linear]")
    model = load_model(config.model, str(llava))
    family = family_of(model)
    tower, projectors = family.vision_tower(model), family.projectors(model)
    assert type(tower).__name__ == "CLIPVisionModel" and [type(m).__name__ for m in projectors] == [
        "LlavaMultiModalProjector"]
    freeze_parts(model, vision=True, aligner=True, llm=False)
    frozen = {id(p) for m in (tower, *projectors) for p in m.parameters()}
    assert all(not p.requires_grad for p in model.parameters() if id(p) in frozen)
    assert all(p.requires_grad for p in family.language_model(model).parameters())
    adapted = [n for n, _ in apply_lora(load_model(config.model, str(llava)), config.model.lora).named_parameters()
               if "lora_" in n]
    assert adapted and all("language_model" in n for n in adapted)


def resolved(tmp_path: Path, *overrides: str) -> Any:
    return resolve(compose(with_default_preset([f"trainer.output_dir={tmp_path}", *overrides])))


def test_the_config_checks_pass_and_log_the_features_turned_off(llava: Path, tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="easytrain.models.families.checks"):
        config = resolved(tmp_path, f"model.path={llava}")
    assert config.data.image_key == "images"
    logged = caplog.text
    assert f"model.dedupe_images: off for llava ({GENERIC} does not support image dedup" in logged
    assert f"worker.actor.share_prompt: off for llava ({GENERIC} does not support shared prompt" in logged


@pytest.mark.parametrize("overrides,message", [
    (["worker.rollout.engine=vllm", "trainer.device=cuda", "model.dtype=bfloat16"],
     f"worker.rollout.engine='vllm': {GENERIC} does not support vllm"),
    (["+exp=tiny_video"], f"data.video_key='videos': {GENERIC} does not support video"),
    (["worker.actor.ulysses_size=2", "worker.actor.padding_free=true"],
     f"worker.actor.ulysses_size=2: {GENERIC} does not support ulysses"),
    (["+exp=tiny_sft"], f"worker.actor.padding_free=True: {GENERIC} does not support padding free"),
])
def test_a_feature_the_generic_adapter_cannot_serve_is_a_one_line_config_error(llava: Path, tmp_path: Path,
                                                                               overrides: list[str],
                                                                               message: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolved(tmp_path, *overrides, f"model.path={llava}")
    text = str(info.value)
    assert "\n" not in text and text.startswith(message), text
    assert "use a model of a family that supports it" in text


@pytest.mark.parametrize("model_type,why", [
    ("mistral3", "no fixed token count (Pixtral sizes images dynamically)"),
    ("llava_next", "a grid of crops (image_grid_pinpoints), which a fixed count would miss"),
])
def test_a_vision_config_without_the_fixed_image_interface_keeps_images_a_config_error(
        llava: Path, tmp_path: Path, model_type: str, why: str) -> None:
    folder = tmp_path / model_type
    folder.mkdir()
    config = {**config_json(llava), "model_type": model_type}
    if model_type == "mistral3":
        config = {k: v for k, v in config.items() if k != "image_seq_length"} | {"vision_config": {}}
    (folder / "config.json").write_text(json.dumps(config))
    family = family_of(config)
    assert family.fixed_image() is None and family.layout() is None, why
    with pytest.raises(ConfigError, match=rf"^data.image_key='images': easytrain has no image adapter for "
                                          rf"model_type={model_type}, and its config states no fixed image size.*"
                                          rf"\(it trains the model's text only\)"):
        resolved(tmp_path / "run", f"model.path={folder}")
    resolved(tmp_path / "text", f"model.path={folder}", "data.image_key=null")  # its text still trains


# ----------------------------------------------------------------------------- end to end


def run_logged(run_dir: Path, *overrides: str) -> str:
    """``python -m easytrain.main`` with ``overrides`` in a process of its own (its own local Ray, no dashboard);
    the run's output, the Ray workers' lines included."""
    proc = subprocess.run([sys.executable, "-m", "easytrain.main", "ray.include_dashboard=false",
                           f"hydra.run.dir={run_dir}", *overrides], cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return proc.stdout


def step_records(run_dir: Path, key: str) -> list[dict[str, Any]]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if key in r and r.get("step", 0) > 0]


def assert_logged_off(log: str) -> None:
    """The defaults the generic adapter cannot serve are turned off with a line each."""
    assert f"model.dedupe_images: off for llava ({GENERIC} does not support image dedup" in log
    assert f"worker.actor.share_prompt: off for llava ({GENERIC} does not support shared prompt" in log


SHORT = ["trainer.max_steps=2", "trainer.val_before_train=false", "trainer.val_freq=-1", "data.synthetic_size=16",
         "data.synthetic_val_size=8", "trainer.loggers=[jsonl]"]


@pytest.mark.slow
def test_grpo_runs_end_to_end_on_the_tiny_llava(llava: Path, tmp_path: Path) -> None:
    """Two GRPO steps on two workers (the HF engine; the reward spreads scores over any responses, so the steps
    have advantages and gradients)."""
    run = tmp_path / "grpo"
    log = run_logged(run, f"model.path={llava}", *SHORT, "data.rollout_batch_size=4", "worker.rollout.n=4",
                     "worker.actor.global_batch_size=4", "worker.actor.micro_batch_size_per_device_for_update=8",
                     "data.max_response_length=3", f"reward.function={ROOT / 'tests/assets/spread_reward.py'}:spread")
    steps = step_records(run, "reward/mean")
    assert [r["step"] for r in steps] == [1, 2]
    assert all(math.isfinite(r[k]) for r in steps for k in ("reward/mean", "actor/pg_loss", "actor/grad_norm"))
    assert all(r["actor/grad_norm"] > 0 for r in steps)
    assert_logged_off(log)
    assert "the HF engine decodes with transformers generate" in log  # no KV reuse for the generic adapter


@pytest.mark.slow
def test_sft_runs_end_to_end_on_the_tiny_llava(llava: Path, tmp_path: Path) -> None:
    run = tmp_path / "sft"
    log = run_logged(run, "+exp=tiny_sft", f"model.path={llava}", *SHORT, "trainer.export_final=false",
                     "worker.actor.padding_free=false", "worker.actor.global_batch_size=4",
                     "worker.actor.micro_batch_size_per_device_for_update=2")
    steps = step_records(run, "train/loss")
    assert [r["step"] for r in steps] == [1, 2]
    assert all(math.isfinite(r["train/loss"]) and r["train/loss"] > 0 for r in steps)
    assert_logged_off(log)
