"""The tiny-model factory: real transformers classes, built locally, loaded like a checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from easytrain.config.schema import ModelConfig
from easytrain.data.vision import expand_image_placeholders, image_token_counts, mm_token_type_ids
from easytrain.models.hf import load_image_processor, load_model, load_tokenizer
from easytrain.models.shapes import resolve_shape, shape_from_hf_config
from easytrain.models.tiny import SPECS, count_parameters

from conftest import tiny_families

CASES = [(f, s) for f in ("qwen2_5_vl", "qwen2_vl", "qwen2") for s in ("tiny", "small")]
PARAMS = {"tiny": (0.1e6, 0.35e6), "small": (3e6, 5e6)}


def _inputs(folder: Path, family: str, images: list[Image.Image]) -> dict[str, torch.Tensor]:
    """Chat-templated prompt with images, placeholders expanded to the vision token count."""
    cfg = ModelConfig(path=str(folder))
    tokenizer = load_tokenizer(cfg)
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": "How many circles are there?"}]
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    vision: dict[str, torch.Tensor] = {}
    if images:
        processor = load_image_processor(cfg)
        vision = dict(processor(images=images, return_tensors="pt"))
        text = expand_image_placeholders(text, image_token_counts(vision["image_grid_thw"], processor.merge_size))
    batch = dict(tokenizer([text], return_tensors="pt"))
    if family != "qwen2":
        image_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
        batch["mm_token_type_ids"] = mm_token_type_ids(batch["input_ids"], image_id)
    return {**batch, **vision}


@pytest.mark.parametrize("family,size", CASES)
def test_tiny_model_loads_trains_and_generates(tiny_model: Callable[..., Path], family: str, size: str) -> None:
    folder = tiny_model(family, size)
    low, high = PARAMS[size]
    assert low <= count_parameters(folder) <= high
    model = load_model(ModelConfig(path=str(folder)))
    text_cfg = model.config.get_text_config()
    assert text_cfg.hidden_size // text_cfg.num_attention_heads >= 32  # vLLM's CPU attention needs >= 32
    assert text_cfg.hidden_size == SPECS[size].hidden

    images = [] if family == "qwen2" else [Image.new("RGB", (56, 84), (200, 30, 30)),
                                           Image.new("RGB", (112, 56), (30, 30, 200))]
    batch = _inputs(folder, family, images)
    if images:
        image_tokens = int((batch["mm_token_type_ids"] == 1).sum())
        assert image_tokens == sum(image_token_counts(batch["image_grid_thw"], 2)) == 6 + 8

    out = model(**batch, labels=batch["input_ids"])
    assert torch.isfinite(out.loss)
    out.loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert sum(float(g.abs().sum()) for g in grads) > 0
    if images:  # the vision tower took part in the graph
        vision = model.model.visual
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in vision.parameters())

    model.eval()
    with torch.no_grad():
        generated = model.generate(**batch, max_new_tokens=6, do_sample=False)
    assert generated.shape[1] == batch["input_ids"].shape[1] + 6


def test_same_seed_same_model_different_seed_different_model(tmp_path: Path) -> None:
    from easytrain.models.tiny import build_tiny

    a = build_tiny("qwen2_5_vl", "tiny", seed=3, cache_dir=tmp_path / "a")
    b = build_tiny("qwen2_5_vl", "tiny", seed=3, cache_dir=tmp_path / "b")
    c = build_tiny("qwen2_5_vl", "tiny", seed=4, cache_dir=tmp_path / "c")
    wa, wb, wc = (load_file(str(d / "model.safetensors")) for d in (a, b, c))
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not all(torch.equal(wa[k], wc[k]) for k in wa)
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()


def test_cache_is_reused(tmp_path: Path) -> None:
    from easytrain.models.tiny import build_tiny

    first = build_tiny("qwen2", "tiny", cache_dir=tmp_path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert build_tiny("qwen2", "tiny", cache_dir=tmp_path) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert not [p for p in (tmp_path / "tiny").iterdir() if p.name.startswith(".")]


def build_on_rank(rank: int, init_method: str, cache: str) -> None:
    import torch.distributed as dist

    from easytrain.models.tiny import build_tiny

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
    try:
        if rank == 1:
            build_tiny("qwen2", "tiny", cache_dir=cache)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_a_build_on_a_non_zero_rank_writes_the_weights(tmp_path: Path) -> None:
    """transformers saves a model only on torch.distributed rank 0; a tiny model built by rank 1 (a Ulysses or
    DeepSpeed rank resolving ``tiny:``) must still be whole, and a folder without config.json is built again."""
    import torch.multiprocessing as mp

    from rendezvous import rendezvous
    from easytrain.models.tiny import build_tiny, tiny_folder_name

    mp.spawn(build_on_rank, args=(rendezvous(tmp_path), str(tmp_path)), nprocs=2, join=True)
    folder = tmp_path / "tiny" / tiny_folder_name("qwen2", "tiny", 0)
    assert {"config.json", "model.safetensors"} <= {p.name for p in folder.iterdir()}
    (folder / "config.json").unlink()  # damaged: a folder that was published without its config
    (folder / "model.safetensors").unlink()
    assert build_tiny("qwen2", "tiny", cache_dir=tmp_path) == folder
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    assert not [p for p in (tmp_path / "tiny").iterdir() if p.name.startswith(".")]


def test_tokenizer_has_qwen_specials_and_template(tiny_model: Callable[..., Path]) -> None:
    tokenizer = load_tokenizer(ModelConfig(path=str(tiny_model("qwen2_5_vl"))))
    for token in ("<|im_start|>", "<|im_end|>", "<|image_pad|>", "<|vision_start|>", "<|endoftext|>"):
        ids = tokenizer(token, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1, token
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nhi<|im_end|>" in text
    # byte-level: any text round-trips
    sample = "Größe 3×4 = 12 ✓ \\boxed{7}"
    assert tokenizer.decode(tokenizer(sample, add_special_tokens=False)["input_ids"]) == sample


@pytest.mark.parametrize("family", tiny_families())
def test_shape_without_building_matches_built_model(tiny_model: Callable[..., Path], family: str) -> None:
    import json

    predicted = resolve_shape(ModelConfig(path=f"tiny:{family}"))
    built = shape_from_hf_config(json.loads((tiny_model(family) / "config.json").read_text()))
    assert predicted == built
    assert built.is_vision == (family != "qwen2")
