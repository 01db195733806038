"""The planner's sequence-dependent arithmetic, pinned by hand-computed cases."""

from __future__ import annotations

from easytrain.config import load
from easytrain.memory.budget import engine_budget, image_tokens, kv_bytes_per_token, sequence_shape
from easytrain.config.presets import known_hf_configs
from easytrain.models.tiny import tiny_hf_config

TEXT = ["+exp=tiny_vllm", "model.path=tiny:qwen2", "data.image_key=null", "data.max_prompt_length=128"]
"""A text model with the vLLM preset: 128 prompt tokens, one response token."""

QWEN25VL_7B = "Qwen/Qwen2.5-VL-7B-Instruct"


def test_image_tokens_at_max_pixels() -> None:
    assert image_tokens(1_003_520) == 1280  # 1003520 px / (14*14 px per patch) / (2*2 patches per token)
    assert image_tokens(12_544) == 16
    assert image_tokens(4_194_304) == 5349  # floor: a 2048x2048 budget


def test_sequence_shape_puts_image_tokens_inside_the_prompt_budget() -> None:
    config = load(["+exp=tiny"])  # the tiny preset: 256 prompt tokens, 1 image at 12544 px, 1 response token
    shape = sequence_shape(config, tiny_hf_config("qwen2_5_vl"))
    assert (shape.prompt_text, shape.images, shape.image_tokens, shape.response) == (240, 1, 16, 1)
    assert shape.total == 257
    big = sequence_shape(load(["+exp=tiny", "data.max_pixels=4194304", "data.limit_images=2"]),
                         tiny_hf_config("qwen2_5_vl"))  # 5349 tokens per image do not fit: 128 each
    assert (big.prompt_text, big.images, big.image_tokens, big.total) == (0, 2, 128, 257)
    text = sequence_shape(load(TEXT), tiny_hf_config("qwen2"))
    assert (text.images, text.prompt, text.total) == (0, 128, 129)

    tools = ["worker.rollout.multi_turn.enable=true", "worker.rollout.multi_turn.tools=[m:f]"]
    turns = sequence_shape(load(["+exp=tiny", *tools, "worker.rollout.multi_turn.max_tool_images=2"]),
                           tiny_hf_config("qwen2_5_vl"))  # two tool images beside the prompt's: 3 priced images
    assert (turns.prompt_text, turns.images, turns.image_tokens, turns.total) == (208, 3, 16, 257)
    text_tools = sequence_shape(load([*TEXT, *tools, "worker.rollout.engine=hf"]),
                                tiny_hf_config("qwen2"))
    assert (text_tools.images, text_tools.total) == (0, 129)  # a text model takes no tool images

    video = sequence_shape(load(["+exp=tiny", "data.video_key=videos", "data.max_frames=5", "data.limit_videos=2"]),
                           tiny_hf_config("qwen2_5_vl"))  # the image and 2 videos of 5 frames: 1 + 2 x 3 patches
    assert (video.images, video.image_tokens, video.total) == (7, 16, 257)
    tight = sequence_shape(load(["+exp=tiny", "data.video_key=videos", "data.max_frames=64"]),
                           tiny_hf_config("qwen2_5_vl"))  # 33 pieces share the 256-token prompt: 7 tokens each
    assert (tight.images, tight.image_tokens) == (33, 7)


def test_kv_cache_per_token() -> None:
    seven = known_hf_configs()[QWEN25VL_7B]
    assert kv_bytes_per_token(seven, "bfloat16") == 57_344  # 2 (K,V) x 28 layers x 4 KV heads x 128 x 2 bytes
    assert kv_bytes_per_token(seven, "bfloat16", tensor_parallel=2) == 28_672
    assert kv_bytes_per_token(seven, "bfloat16", tensor_parallel=8) == 14_336  # 4 KV heads over 8: replicated
    seventy_two = known_hf_configs()["Qwen/Qwen2.5-VL-72B-Instruct"]
    assert kv_bytes_per_token(seventy_two, "bfloat16", tensor_parallel=4) == 81_920  # 2 x 80 x 2 x 128 x 2


def test_vllm_budget_on_an_80_gb_gpu() -> None:
    """7B, TP 2, 0.6 of 80 GiB: 51,539,607,552 reserved; bf16 weights 4,146,083,328 params x 2 bytes per GPU;
    the rest is KV cache: 43,247,440,896 bytes / (28,672 bytes x 4096 tokens) = 368 full sequences."""
    budget = engine_budget(80 * 2**30, 0.6, 8_292_166_656, known_hf_configs()[QWEN25VL_7B], "bfloat16",
                           tensor_parallel=2, sequence_tokens=4096)
    assert (budget.reserved, budget.weights, budget.kv_cache) == (51_539_607_552, 8_292_166_656, 43_247_440_896)
    assert budget.max_sequences == 368
    starved = engine_budget(16 * 2**30, 0.3, 8_292_166_656, known_hf_configs()[QWEN25VL_7B], "bfloat16", 1, 4096)
    assert starved.kv_cache == 0 and starved.max_sequences == 0  # 5.2 GB reserved < 16.6 GB of weights
