"""Random Qwen2.5-VL models bigger than the tiny factory's, for benchmarks and the GPU suite: the tiny factory's
tokenizer, processor and token ids with a bigger text model and vision tower, written once with
``save_pretrained`` into ``~/.cache/easytrain/<tag>_<hash>``.

- the ~180M model the planner benchmarks run (bench/planner_accuracy.py): :func:`bench_model_folder`;
- the ~0.6B model of the GPU suite (tests/gpu, bench/gpu_smoke.py): the text model of Qwen2.5-0.5B (its
  public config.json: 24 layers of 896, 151,936 tokens, tied embeddings) under a 4-block vision tower of
  Qwen2.5-VL's width: ``bench_model_folder(HALF_B_TEXT, HALF_B_VISION, tag="gpu_half_b", tie=True)``."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Optional

BENCH_MODEL = "{bench_model}"
"""Placeholder in the overrides for the folder of the ~180M model (machine-specific)."""
BENCH_TEXT = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 2,
              "intermediate_size": 3072, "vocab_size": 32000}
BENCH_VISION = {"depth": 8, "hidden_size": 512, "num_heads": 8, "intermediate_size": 1536, "out_hidden_size": 768,
                "fullatt_block_indexes": [3, 7]}
HALF_B_TEXT = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
               "intermediate_size": 4864, "vocab_size": 151936}
HALF_B_VISION = {"depth": 4, "hidden_size": 1280, "num_heads": 16, "intermediate_size": 3420, "out_hidden_size": 896,
                 "fullatt_block_indexes": [3]}


def bench_model_folder(text: Optional[dict[str, Any]] = None, vision: Optional[dict[str, Any]] = None,
                       tag: str = "bench_planner", tie: bool = False) -> Path:
    """A random Qwen2.5-VL of the ``text`` and ``vision`` shapes (default: the ~180M one) with the tiny factory's
    tokenizer, processor and token ids, saved once with ``save_pretrained`` into the easytrain cache."""
    import torch
    import transformers

    from easytrain.models.tiny import build_tiny, default_cache_dir

    tiny = build_tiny("qwen2_5_vl", "small")
    raw = json.loads((tiny / "config.json").read_text())
    for key in ("architectures", "transformers_version", "dtype"):
        raw.pop(key, None)
    raw["text_config"].pop("layer_types", None)  # one per layer: rebuilt for the new depth
    raw["text_config"].update(BENCH_TEXT if text is None else text)
    raw["vision_config"].update(BENCH_VISION if vision is None else vision)
    raw["tie_word_embeddings"] = tie
    key = hashlib.sha1(json.dumps([raw, tiny.name, transformers.__version__], sort_keys=True).encode()).hexdigest()
    folder = default_cache_dir() / f"{tag}_{key[:10]}"
    if (folder / "config.json").is_file():
        return folder
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    config = transformers.AutoConfig.for_model(raw.pop("model_type"), **raw)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.Qwen2_5_VLForConditionalGeneration(config).to(torch.float32)
    model.save_pretrained(tmp)
    for file in tiny.iterdir():  # tokenizer, chat template, image processor, generation config
        if file.name not in ("config.json", "model.safetensors"):
            shutil.copy(file, tmp / file.name)
    os.replace(tmp, folder)
    return folder
