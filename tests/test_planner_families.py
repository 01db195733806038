"""The planner prices Qwen3-VL, InternVL and Gemma 3 from their own HF configs: image geometry (patch size, merge,
tiles, fixed images), vision and language-model dimensions, mixture-of-experts widths, and the Qwen3-VL-8B preset's
plan on one node of 8 x 80 GB."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from easytrain.config import load
from easytrain.config.presets import known_hf_configs
from easytrain.memory.activations import PATCH_VALUES, model_dims
from easytrain.memory.budget import image_tokens, sequence_shape, tokens_per_image
from easytrain.memory.vision import vision_geometry

KNOWN = known_hf_configs()
QWEN25VL_7B = KNOWN["Qwen/Qwen2.5-VL-7B-Instruct"]
QWEN3VL_8B = KNOWN["Qwen/Qwen3-VL-8B-Instruct"]
QWEN3VL_MOE = KNOWN["Qwen/Qwen3-VL-30B-A3B-Instruct"]
INTERNVL3_8B = KNOWN["OpenGVLab/InternVL3-8B-hf"]
INTERNVL3_38B = KNOWN["OpenGVLab/InternVL3-38B-hf"]
GEMMA3_4B = KNOWN["google/gemma-3-4b-it"]
TILE = 448 * 448


def test_qwen2_vl_geometry_is_what_it_was() -> None:
    """Qwen2.5-VL: 14-px patches merged 2x2, two frames a patch: the planner's old constants."""
    g = vision_geometry(QWEN25VL_7B)
    assert g is not None and (g.patch, g.merge, g.temporal, g.cell) == (14, 2, 2, 28)
    assert g.patch_values == PATCH_VALUES and g.values_per_token == 4 * PATCH_VALUES
    for pixels in (12_544, 1_003_520, 4_194_304):
        assert g.image_tokens(pixels) == image_tokens(pixels) == tokens_per_image(QWEN25VL_7B, pixels)
    assert vision_geometry(KNOWN["Qwen/Qwen2.5-7B-Instruct"]) is None  # text only
    assert tokens_per_image(KNOWN["Qwen/Qwen2.5-7B-Instruct"], 1_003_520) == 0


def test_qwen3_vl_images_are_16_px_patches_merged_2x2() -> None:
    """Qwen3-VL's patches are 16 px: a token per 32 x 32 px, 3 x 2 x 16 x 16 values a patch."""
    for hf in (QWEN3VL_8B, QWEN3VL_MOE):
        g = vision_geometry(hf)
        assert g is not None and (g.patch, g.merge, g.temporal, g.cell) == (16, 2, 2, 32)
        assert g.image_tokens(1_003_520) == 1_003_520 // 1024 == 980
        assert g.image_tokens(4_194_304) == 4096 == image_tokens(4_194_304, merge=2, patch=16)
        assert g.values_per_token == 4 * 3 * 2 * 16 * 16


def test_internvl_images_are_tiles_and_a_thumbnail() -> None:
    """InternVL3: 448-px tiles of 14-px patches, pixel-shuffled 2 x 2 (downsample_ratio 0.5): 256 tokens a tile,
    and one thumbnail tile more when an image has several."""
    for hf in (INTERNVL3_8B, INTERNVL3_38B):
        g = vision_geometry(hf)
        assert g is not None and (g.patch, g.merge, g.temporal, g.cell, g.tokens_per_cell) == (14, 2, 1, 448, 256)
        assert g.image_tokens(TILE) == 256  # one tile, no thumbnail
        assert g.image_tokens(100 * 100) == 256  # a small image still takes a tile
        assert g.image_tokens(4 * TILE) == (4 + 1) * 256
        assert g.image_tokens(4_194_304) == (4_194_304 // TILE + 1) * 256
        assert g.values_per_token * 256 == 3 * 448 * 448  # a tile's pixel values behind its 256 tokens


def test_gemma3_images_are_one_fixed_896_px_image_of_256_tokens() -> None:
    g = vision_geometry(GEMMA3_4B)
    assert g is not None and (g.patch, g.merge, g.cell, g.tokens_per_cell) == (14, 4, 896, 256)
    assert {g.image_tokens(pixels) for pixels in (50 * 50, 896 * 896, 4_194_304)} == {256}
    assert g.values_per_token * 256 == 3 * 896 * 896  # 64 x 64 patches average-pooled 4 x 4


def test_model_dims_read_each_familys_vision_config() -> None:
    """Depth, width and MLP width from depth/hidden_size (Qwen-VL) or num_hidden_layers/hidden_size (InternViT,
    SigLIP); only Qwen2.5-VL's vision MLP is gated; only Qwen-VL's language model takes 3-D rope."""
    expect = {  # (vision hidden, layers, intermediate, gated, merge, mrope, qk norm)
        "Qwen/Qwen2.5-VL-7B-Instruct": (1280, 32, 3420, True, 2, True, False),
        "Qwen/Qwen2-VL-7B-Instruct": (1280, 32, 5120, False, 2, True, False),
        "Qwen/Qwen3-VL-8B-Instruct": (1152, 27, 4304, False, 2, True, True),
        "Qwen/Qwen3-VL-2B-Instruct": (1024, 24, 4096, False, 2, True, True),
        "OpenGVLab/InternVL3-8B-hf": (1024, 24, 4096, False, 2, False, False),
        "OpenGVLab/InternVL3-38B-hf": (3200, 45, 12800, False, 2, False, False),
        "google/gemma-3-4b-it": (1152, 27, 4304, False, 4, False, True),
    }
    for hub_id, want in expect.items():
        d = model_dims(KNOWN[hub_id])
        got = (d.vision_hidden, d.vision_layers, d.vision_intermediate, d.vision_gated, d.merge, d.mrope, d.qk_norm)
        assert got == want, hub_id
    gemma = model_dims(GEMMA3_4B)
    assert (gemma.hidden, gemma.head_dim, gemma.q, gemma.kv, gemma.vocab) == (2560, 256, 8 * 256, 4 * 256, 262_208)
    assert gemma.sandwich_norm and not model_dims(QWEN3VL_8B).sandwich_norm
    eight = model_dims(QWEN3VL_8B)
    assert (eight.hidden, eight.layers, eight.intermediate, eight.kv, eight.vocab) == (4096, 36, 12288, 1024, 151_936)
    assert model_dims(QWEN3VL_MOE).intermediate == 8 * 768  # the experts one token is routed to


@pytest.mark.parametrize("hub_id,per_image", [
    ("Qwen/Qwen3-VL-8B-Instruct", 1_003_520 // 1024),
    ("OpenGVLab/InternVL3-8B-hf", (1_003_520 // TILE + 1) * 256),
    ("google/gemma-3-4b-it", 256),
])
def test_sequences_take_each_familys_image_tokens(hub_id: str, per_image: int) -> None:
    """An image at data.max_pixels takes the family's tokens (within the prompt budget)."""
    config = load(["+exp=qwen3vl_8b", f"model.path={hub_id}", "data.max_pixels=1003520", "data.max_prompt_length=4096"])
    seq = sequence_shape(config, KNOWN[hub_id])
    assert (seq.images, seq.image_tokens, seq.prompt_text) == (1, per_image, 4096 - per_image)


def _plan(*overrides: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "easytrain.cli", "plan", "--format", "json", *overrides],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.slow
def test_qwen3vl_8b_preset_fits_one_node_of_8_x_80_gb() -> None:
    """`easytrain plan +exp=qwen3vl_8b`: GRPO of Qwen3-VL-8B on 8 x 80 GB fits, every phase under the GPU."""
    report = _plan("+exp=qwen3vl_8b")
    assert report["capacity"]["gpu_bytes"] == 80_000_000_000
    phases = {p["phase"]: p for p in report["phases"]}
    assert {"generation", "ref_log_probs", "old_log_probs", "update", "weight_sync", "validation"} <= set(phases)
    assert report["device_peak_bytes"] == max(p["device_bytes"] for p in phases.values())
    assert report["device_peak_bytes"] < 80_000_000_000 and report["fits"] is True
    text = subprocess.run([sys.executable, "-m", "easytrain.cli", "plan", "+exp=qwen3vl_8b"], capture_output=True,
                          text=True, timeout=600, check=True).stdout
    assert "model Qwen/Qwen3-VL-8B-Instruct: 8.77B parameters" in text and "verdict: fits" in text


def test_qwen3vl_8b_preset_composes() -> None:
    config = load(["+exp=qwen3vl_8b"])
    assert config.model.path == "Qwen/Qwen3-VL-8B-Instruct"
    assert (config.trainer.nnodes, config.trainer.workers_per_node, config.trainer.gpu_memory_gb) == (1, 8, 80)
    assert config.worker.rollout.engine == "vllm" and config.worker.rollout.tensor_parallel_size == 2


def test_pixel_values_follow_the_models_patches() -> None:
    """The step batch's pixel values: 6144 fp32 values an image token for Qwen3-VL (4 patches of 3 x 2 x 16 x 16),
    4704 for Qwen2.5-VL."""
    from easytrain.memory.planner import batch_bytes, shape_of

    for hub_id, values in (("Qwen/Qwen3-VL-8B-Instruct", 6144), ("Qwen/Qwen2.5-VL-7B-Instruct", 4704)):
        config = load(["+exp=qwen3vl_8b", f"model.path={hub_id}"])
        s = shape_of(config, KNOWN[hub_id])
        assert s.values_per_token == values
        prompts = config.data.rollout_batch_size
        text = s.seq_tokens * 8 * 6 + s.response * (8 + 8 + 4 * 4)
        # every sequence's tensors; a prompt's pixels once, shared by its n samples
        assert batch_bytes(config, s) == prompts * (config.worker.rollout.n * text + s.images * s.image_tokens * values * 4)


@pytest.mark.parametrize("hub_id,per_image,values", [
    ("Qwen/Qwen2-VL-7B-Instruct", 1024, 4704),  # 1280 at max_pixels, capped at a quarter of the 4096-token sample
    ("Qwen/Qwen3-VL-8B-Instruct", 980, 6144),
    ("OpenGVLab/InternVL3-8B-hf", 1024, 2352),  # 4 tiles + thumbnail = 1280, capped likewise
    ("google/gemma-3-12b-it", 256, 9408),
])
def test_sft_samples_take_each_familys_image_tokens(hub_id: str, per_image: int, values: int) -> None:
    """The SFT plan (4 images at 1003520 px, 2048 + 2048 tokens a sample) reads the same geometry."""
    from easytrain.memory.sft import sample_images, sft_shape

    config = load(["+exp=qwen2vl_7b_sft", f"model.path={hub_id}"])
    assert sample_images(config, KNOWN[hub_id]) == (4, per_image)
    assert sft_shape(config, KNOWN[hub_id]).values_per_token == values


def test_plan_names_a_mixture_of_experts_active_parameters() -> None:
    from easytrain.memory.report import plan_command

    moe = plan_command(load(["+exp=qwen3vl_8b", "model.path=Qwen/Qwen3-VL-30B-A3B-Instruct"]), "table", False)
    assert "31.07B parameters (3.89B active per token);" in moe
    dense = plan_command(load(["+exp=qwen3vl_8b"]), "table", False)
    assert "8.77B parameters;" in dense and "active per token" not in dense
