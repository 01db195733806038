"""The ~180M-parameter random Qwen2.5-VL the planner benchmarks run (bench/planner_accuracy.py): the tiny
factory's tokenizer, processor and token ids with a bigger text model and vision tower, written once with
``save_pretrained`` into ``~/.cache/easytrain/bench_planner_<hash>``."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

BENCH_MODEL = "{bench_model}"
"""Placeholder in the overrides for the folder of the ~180M model (machine-specific)."""
BENCH_TEXT = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 2,
              "intermediate_size": 3072, "vocab_size": 32000}
BENCH_VISION = {"depth": 8, "hidden_size": 512, "num_heads": 8, "intermediate_size": 1536, "out_hidden_size": 768,
                "fullatt_block_indexes": [3, 7]}


def bench_model_folder() -> Path:
    """A random Qwen2.5-VL of ~180M parameters with the tiny factory's tokenizer, processor and token
    ids, saved once with ``save_pretrained`` into the easytrain cache."""
    import torch
    import transformers

    from easytrain.models.tiny import build_tiny, default_cache_dir

    tiny = build_tiny("qwen2_5_vl", "small")
    raw = json.loads((tiny / "config.json").read_text())
    for key in ("architectures", "transformers_version", "dtype"):
        raw.pop(key, None)
    raw["text_config"].pop("layer_types", None)  # one per layer: rebuilt for the new depth
    raw["text_config"].update(BENCH_TEXT)
    raw["vision_config"].update(BENCH_VISION)
    raw["tie_word_embeddings"] = False
    key = hashlib.sha1(json.dumps([raw, tiny.name, transformers.__version__], sort_keys=True).encode()).hexdigest()
    folder = default_cache_dir() / f"bench_planner_{key[:10]}"
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
