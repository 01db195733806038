"""Issue 33: one adapter per model family. Each family with a tiny model goes through the data pipeline into its
real transformers class; positions, image tokens, tiles, freezes, LoRA, the planner and the feature checks follow
the family's adapter. (Packing, prompt sharing, image dedup and the parameter counts are checked per family in
their own test files, parametrised over the same families.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from easytrain import cli
from easytrain.config import ConfigError, compose, with_default_preset
from easytrain.config.schema import ModelConfig
from easytrain.data.images import fit_image
from easytrain.main import resolve
from easytrain.models.families import ADAPTERS, TINY_FAMILIES, family_of
from easytrain.models.families.base import Bound
from easytrain.models.hf import load_image_processor, load_model, load_tokenizer, model_folder
from easytrain.trainer.data import RLData

from rl_batches import rl_config

VL_FAMILIES = [f for f in TINY_FAMILIES if f != "qwen2"]


def prompt_batch(tmp_path: Path, family: str, *extra: str) -> tuple[RLData, dict[str, Any], torch.nn.Module]:
    """The family's data, a collated batch of four prompts (with their positions) and the model."""
    data = RLData(rl_config(tmp_path, f"model.path=tiny:{family}", *extra))
    model = load_model(data.config.model, model_folder(data.config.model)).eval()
    return data, data.collator([data.train[i] for i in range(4)]), model


def test_every_family_with_an_adapter_is_listed_once_and_the_tiny_ones_build() -> None:
    types = [t for cls in ADAPTERS for t in cls.model_types]
    assert len(types) == len(set(types))
    assert {"qwen2_5_vl", "qwen2_vl", "qwen3_vl", "internvl", "qwen2"} <= set(TINY_FAMILIES)
    assert family_of({"model_type": "llama"}).features == frozenset()  # the generic adapter: no family features


@pytest.mark.parametrize("family", VL_FAMILIES)
def test_image_tokens_equal_the_towers_features_and_the_forward_runs(family: str, tmp_path: Path) -> None:
    data, prompts, model = prompt_batch(tmp_path, family)
    adapter = family_of(model)
    image_id = int(model.config.image_token_id)
    tokens = adapter.visual_tokens(prompts["image_grid_thw"])
    assert sum(tokens) == int((prompts["input_ids"] == image_id).sum()) > 0
    assert [int(n) for n in (prompts["input_ids"] == image_id).sum(-1)] == tokens  # one image per prompt
    assert int(adapter.visual_rows(prompts["image_grid_thw"]).sum()) == prompts["pixel_values"].shape[0]
    inputs = {k: prompts[k] for k in ("input_ids", "attention_mask", "position_ids")}
    with torch.no_grad():
        logits = model(**inputs, **adapter.model_kwargs(prompts)).logits
    assert torch.isfinite(logits).all()
    assert prompts["position_ids"].dim() == (3 if adapter.rope_rows else 2)


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5", "qwen2_5_vl"])
def test_qwen_positions_equal_the_models_rope_index(family: str, tmp_path: Path) -> None:
    _, prompts, model = prompt_batch(tmp_path, family)
    kwargs = family_of(model).visual_kwargs(prompts)
    want, _ = model.model.get_rope_index(prompts["input_ids"], prompts["mm_token_type_ids"], kwargs["image_grid_thw"],
                                         None, attention_mask=prompts["attention_mask"])
    mask = prompts["attention_mask"].bool()
    assert torch.equal(prompts["position_ids"][:, mask], want[:, mask])


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_assembled_positions_equal_the_whole_rows(family: str, tmp_path: Path) -> None:
    """assemble places each prompt's rotary rows once and continues its text responses from there: the positions
    the adapter gives every whole row (prompt and response), the responses continued after the prompt."""
    from easytrain.distributed.batch import Batch
    from easytrain.workers.sequences import assemble, continue_after_prompt

    data = RLData(rl_config(tmp_path, f"model.path=tiny:{family}"))
    prompts = next(data.train_batches())
    n, width = 3, 5
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, width + 1, (len(prompts) * n,), generator=generator)
    mask = (torch.arange(width)[None] < lengths[:, None]).long()
    responses = torch.randint(10, 100, (len(prompts) * n, width), generator=generator) * mask
    batch = assemble(prompts, Batch({"responses": responses, "response_mask": mask}), n, data.family)
    rows = prompts.repeat_interleave(n)
    want = data.family.positions(batch["input_ids"], batch["mm_token_type_ids"], rows.tensors,
                                 batch["attention_mask"])
    continue_after_prompt(want, batch["attention_mask"], rows["input_ids"].shape[1])
    assert want.shape[0] == 3 and torch.equal(batch["position_ids"], want)


@pytest.mark.parametrize("size", [(56, 56), (112, 112), (168, 56), (56, 168), (100, 120), (30, 200), (224, 112)])
def test_internvl_tiles_follow_the_layout_and_equal_the_processors_own(size: tuple[int, int],
                                                                      tiny_model: Any) -> None:
    """The dataset sizes an image onto the tile grid; the image processor then cuts exactly the tiles (and the
    thumbnail) the layout counted, with the processor's own pixel values."""
    folder = str(tiny_model("internvl"))
    adapter = family_of(json.loads((Path(folder) / "config.json").read_text()))
    processor = adapter.image_processor(folder)
    layout = adapter.layout(processor)
    image = fit_image(Image.effect_noise(size, 40).convert("RGB"), 3136, 4 * 3136, layout.factor)
    cells = (image.height // layout.factor) * (image.width // layout.factor)
    assert 1 <= cells <= 4 and image.height % 56 == 0 and image.width % 56 == 0
    stream = adapter.vision_stream(processor, [[image]], [[]], [[1]])
    tiles = cells + (cells > 1)
    assert stream["image_grid_thw"].tolist() == [[tiles, 1, 1]]
    assert adapter.visual_tokens(stream["image_grid_thw"]) == [layout.image_tokens(image.height, image.width)]
    own = processor(images=[image], return_tensors="pt", crop_to_patches=cells > 1, max_patches=cells)
    assert torch.equal(stream["pixel_values"], own["pixel_values"].reshape(tiles, -1).float())


@pytest.mark.parametrize("family", VL_FAMILIES)
def test_freezes_and_lora_follow_the_adapters_module_paths(family: str, tmp_path: Path) -> None:
    from easytrain.models.parts import apply_lora, freeze_parts

    config = rl_config(tmp_path, f"model.path=tiny:{family}", "model.lora.rank=4",
                       "model.lora.target_modules=[all-linear]")
    folder = model_folder(config.model)

    def fresh() -> torch.nn.Module:
        return load_model(config.model, folder)

    model = fresh()
    adapter = family_of(model)
    tower = {id(p) for p in adapter.vision_tower(model).parameters()}
    projector = {id(p) for m in adapter.projectors(model) for p in m.parameters()}
    assert projector and projector < tower or projector.isdisjoint(tower)
    freeze_parts(model, vision=True, aligner=False, llm=False)
    trains = {id(p) for p in model.parameters() if p.requires_grad}
    assert trains & tower == projector & tower and projector <= trains  # the projector trains, the tower does not
    model = fresh()
    freeze_parts(model, vision=False, aligner=True, llm=False)
    assert not {id(p) for p in model.parameters() if p.requires_grad} & projector
    model = fresh()
    language = {id(p) for p in adapter.language_model(model).parameters()}
    freeze_parts(model, vision=False, aligner=False, llm=True)
    assert not {id(p) for p in model.parameters() if p.requires_grad} & language
    lora = apply_lora(fresh(), config.model.lora)
    adapted = [n for n, _ in lora.named_parameters() if "lora_" in n]
    assert adapted and all("language_model" in n for n in adapted)
    assert all(not p.requires_grad for n, p in lora.named_parameters() if "lora_" not in n)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_plan_runs_for_every_tiny_family(family: str, capsys: pytest.CaptureFixture) -> None:
    """In this process (tests/test_memory_planner.py runs the command in a process of its own)."""
    with pytest.raises(SystemExit) as done:
        cli.main(["plan", "--format", "json", f"model.path=tiny:{family}"])
    out = capsys.readouterr()
    assert done.value.code == 0, out.err[-2000:]
    report = json.loads(out.out)
    assert report["device_peak_bytes"] > 0 and report["phases"]


@pytest.mark.parametrize("overrides,message", [
    (["model.path=tiny:qwen3_vl", "worker.actor.ulysses_size=2", "worker.actor.padding_free=true"],
     "worker.actor.ulysses_size=2: Qwen3-VL (qwen3_vl) does not support ulysses"),
    (["model.path=tiny:gemma3", "worker.rollout.engine=vllm", "trainer.device=cuda", "model.dtype=bfloat16"],
     "worker.rollout.engine='vllm': Gemma 3 (gemma3) does not support vllm in easytrain: not built (vLLM 0.32"),
    (["+exp=tiny_video", "model.path=tiny:qwen3_vl"], "data.video_key='videos': Qwen3-VL (qwen3_vl) does not support"),
    (["model.path=tiny:gemma3", "+exp=tiny_sft", "worker.actor.ulysses_size=2"],
     "worker.actor.ulysses_size=2: Gemma 3 (gemma3) does not support ulysses"),
    (["model.path=tiny:gemma3", "+exp=tiny_sft"], "worker.actor.padding_free=True: Gemma 3 (gemma3) does not support"),
])
def test_a_feature_the_family_cannot_serve_is_a_one_line_config_error(overrides: list[str], message: str,
                                                                      tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        resolve(compose(with_default_preset([f"trainer.output_dir={tmp_path}", *overrides])))
    text = str(info.value)
    assert "\n" not in text and text.startswith(message), text
    assert "use a model of a family that supports it" in text


def test_a_family_without_an_adapter_or_fixed_images_trains_text_and_refuses_images(tmp_path: Path,
                                                                                   tiny_model: Any) -> None:
    """A model_type easytrain has no adapter for gets the generic one; where its config lacks transformers' common
    fixed-size image interface (mistral3: Pixtral sizes images dynamically, no fixed token count), images are a
    config error naming the key. (tests/test_generic_family.py: a LLaVA, which has it, trains on images.)"""
    folder = tmp_path / "other"
    folder.mkdir()
    config = json.loads((tiny_model("qwen2") / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "mistral3", "vision_config": {}}))
    with pytest.raises(ConfigError, match=r"^data.image_key='images': easytrain has no image adapter for "
                                          r"model_type=mistral3"):
        resolve(compose(with_default_preset([f"trainer.output_dir={tmp_path}", f"model.path={folder}"])))


def test_a_bound_family_builds_the_collators_vision_inputs(tiny_model: Any) -> None:
    """Bound.of finds the layout's placeholder ids in the tokenizer (what the trainer hands its collators)."""
    from easytrain.config.schema import ModelConfig
    from easytrain.models.hf import load_tokenizer

    folder = str(tiny_model("internvl"))
    cfg = ModelConfig(path=folder)
    tokenizer = load_tokenizer(cfg)
    bound = Bound.of(family_of(json.loads((Path(folder) / "config.json").read_text())), load_image_processor(cfg),
                     tokenizer)
    assert bound.image_token_id == tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>") >= 0
    assert bound.video_token_id == -1


def test_a_family_whose_cache_rows_cannot_be_reused_generates_with_generate(tmp_path: Path) -> None:
    """Qwen3.5's linear-attention states cannot be copied or dropped by row: the HF engine decodes with transformers
    generate instead of its own loops, and the responses' log-probs still equal the training forward's."""
    from easytrain.trainer.data import to_batch
    from easytrain.workers.forward import response_log_probs
    from easytrain.workers.rollout.engine import SamplingParams
    from easytrain.workers.rollout.hf_engine import HFEngine
    from easytrain.workers.sequences import assemble

    data, raw, model = prompt_batch(tmp_path, "qwen3_5")
    prompts = to_batch(raw, keep_images=False)
    engine = HFEngine(model, [-1], data.tokenizer.pad_token_id, torch.device("cpu"))  # asks for both by default
    assert not engine.reuses_kv and engine.static is None
    out = engine.generate(prompts, SamplingParams(2, 1.0, 1.0, -1, 4, seed=1))
    batch = assemble(prompts, out, 2, family_of(model))
    log_probs, _ = response_log_probs(model, batch, 1.0, torch.device("cpu"))
    mask = batch["response_mask"].bool()
    assert mask.sum() == 4 * 2 * 4  # no stop token: every row decodes its 4 tokens
    torch.testing.assert_close(log_probs[mask], out["rollout_log_probs"][mask], rtol=1e-4, atol=1e-4)


def test_vllm_takes_the_familys_processor_bounds_with_images(tmp_path: Path) -> None:
    """The vLLM engine's image-processor arguments come from the adapter: Qwen-VL's area bounds (the data's pixel
    range, so vLLM does not resize the pipeline's images again); none for the generic adapter; no image
    arguments at all for a text run."""
    from easytrain.workers.rollout.engine import EngineSpec
    from easytrain.workers.rollout.vllm_engine import engine_kwargs

    config = rl_config(tmp_path, "model.path=tiny:qwen2_5_vl")
    spec = EngineSpec(folder=Path(model_folder(config.model)), stop_ids=[2], pad_id=0, device=torch.device("cpu"))
    d = config.data
    kwargs = engine_kwargs(config, spec, family_of(json.loads((spec.folder / "config.json").read_text())))
    assert kwargs["mm_processor_kwargs"] == {"size": {"shortest_edge": d.min_pixels, "longest_edge": d.max_pixels}}
    assert kwargs["limit_mm_per_prompt"] == {"image": d.limit_images}
    turns = rl_config(tmp_path, "model.path=tiny:qwen2_5_vl", "worker.rollout.multi_turn.enable=true",
                      "worker.rollout.multi_turn.tools=[m:f]", "worker.rollout.multi_turn.max_tool_images=3")
    assert engine_kwargs(turns, spec, family_of(json.loads((spec.folder / "config.json").read_text())))[
        "limit_mm_per_prompt"] == {"image": d.limit_images + 3}  # a conversation's tool images beside the prompt's
    generic = family_of({"model_type": "llava", "vision_config": {"model_type": "clip_vision_model"}})
    assert engine_kwargs(config, spec, generic)["mm_processor_kwargs"] == {}
    assert "mm_processor_kwargs" not in engine_kwargs(config, spec)


def test_vllm_gets_one_pad_per_image_and_expands_it_to_the_actors_count() -> None:
    """Qwen-VL prompts reach vLLM with each image's (and video's) run of pads as one pad, which vLLM's processor
    expands again; every other token, a lone pad and the runs' order stay as they were."""
    hf = json.loads((Path(model_folder(ModelConfig(path="tiny:qwen2_5_vl"))) / "config.json").read_text())
    family = family_of(hf)
    image, video = hf["image_token_id"], hf["video_token_id"]
    start, end = hf["vision_start_token_id"], hf["vision_end_token_id"]
    ids = [5, start, *[image] * 4, end, 7, start, *[video] * 3, end, start, image, end, 9]
    assert family.vllm_prompt_ids(ids) == [5, start, image, end, 7, start, video, end, start, image, end, 9]
    assert family.vllm_prompt_ids([5, 6, 7]) == [5, 6, 7]
    generic = family_of({"model_type": "llava", "vision_config": {"model_type": "clip_vision_model"}})
    assert generic.vllm_prompt_ids(ids) == ids  # a family that does not serve vLLM with images is never asked


def test_internvl_hands_vllm_one_context_token_per_image() -> None:
    """InternVL prompts reach vLLM with each image's ``<img>`` + context tokens + ``</img>`` as one context token,
    where vLLM's processor writes the whole run again."""
    folder = Path(model_folder(ModelConfig(path="tiny:internvl")))
    family = family_of(json.loads((folder / "config.json").read_text()))
    tokenizer = load_tokenizer(ModelConfig(path="tiny:internvl"), folder)
    context, start, end = (tokenizer.convert_tokens_to_ids(t) for t in ("<IMG_CONTEXT>", "<img>", "</img>"))
    assert (tokenizer.context_image_token_id, tokenizer.start_image_token_id) == (context, start)  # vLLM reads these
    ids = [500, start, *[context] * 4, end, 700, start, *[context] * 20, end, start, context, end, 900]
    assert family.vllm_prompt_ids(ids) == [500, context, 700, context, context, 900]
    assert family.vllm_prompt_ids([500, 600, 700]) == [500, 600, 700]


def test_a_models_adapter_is_found_through_a_wrapper_and_made_once(tiny_model: Any) -> None:
    """A loaded model's adapter is made once and kept for it; a wrapper whose own ``config`` is not the model's
    (DeepSpeed's engine holds its JSON settings there) answers with the model it wraps."""
    model = load_model(ModelConfig(path="tiny:qwen2_5_vl"), str(tiny_model("qwen2_5_vl")))
    family = family_of(model)
    assert family.model_type == "qwen2_5_vl" and family_of(model) is family

    class Engine(torch.nn.Module):  # the shape of deepspeed.DeepSpeedEngine: .module, and .config its settings
        def __init__(self, module: torch.nn.Module) -> None:
            super().__init__()
            self.module, self.config = module, {"train_batch_size": 4}

    assert family_of(Engine(model)) is family
