"""Real-shaped models with random weights: ``model.path=random:<name>``, nothing downloaded.

``random:<name>`` is the architecture of ``conf/model/<name>.yaml`` (the shape settings of the published
checkpoint's config.json) with transformers' own random initialisation, paired with the tiny tokenizer and image
processor of its family; the model's vocabulary is larger than the tokenizer's, as published models' often
are. Planner checks, GPU smoke tests and dry runs at a real size then need no checkpoint, and
``easytrain plan`` prices it exactly as the checkpoint it copies (models/shapes.py reads the same file).

``build_random`` writes, once per name, seed and shape, a cache folder that loads like a checkpoint's apart from
the weights: ``config.json`` (the preset's shape with the tiny tokenizer's special-token ids), the tiny folder's
tokenizer, chat template, image processor and generation config, and ``random_init.json`` (name and seed) where
the weights would be. ``load_model`` (models/hf.py) sees the marker and calls ``random_model``, which builds the
architecture on the meta device, allocates it on the target device (a GPU model never has a host copy) and
initialises it there. The weights follow from the seed, dtype and device: roles that load in the same dtype on
the same device (actor and reference) start equal; the rollout engine gets the actor's weights by a sync
(trainer/rl.py), and vLLM starts from its own dummy weights (``load_format="dummy"``).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import shutil
from pathlib import Path
from typing import Any, Union

import torch

from easytrain.config.presets import RANDOM_PREFIX, random_hf_config
from easytrain.config.errors import ConfigError
from easytrain.models.families import adapter_class
from easytrain.models.tiny import FAMILIES as TINY_FAMILIES
from easytrain.models.tiny import build_once, build_tiny, default_cache_dir, model_class_for

logger = logging.getLogger(__name__)

MARKER = "random_init.json"
"""Stands in a random: folder where the weights would be: its name and seed."""
FACTORY_VERSION = 1
"""Bump when the folder's contents change, so cached folders from older builds are not reused."""
TOKEN_ID_KEYS = ("_token_id", "_token_index")
"""Config keys that hold a special token's id (some families name their image tokens ``*_token_index``)."""
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json")


def build_random(name: str, seed: int = 0, cache_dir: Union[str, Path, None] = None) -> Path:
    """The folder of ``random:<name>`` (built into the cache on first use); a ConfigError for unknown names."""
    import transformers

    shape = random_hf_config(RANDOM_PREFIX + name)
    source = adapter_class(shape["model_type"]).tiny_family()
    if source not in TINY_FAMILIES:
        raise ConfigError("model.path", RANDOM_PREFIX + name, f"no tiny tokenizer of its family "
                          f"({shape['model_type']}) to pair the random weights with",
                          "use a conf/model preset of a family with a tiny model: " + ", ".join(TINY_FAMILIES))
    tiny = build_tiny(source, "tiny", seed, cache_dir)
    cache = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    key = json.dumps([FACTORY_VERSION, name, shape, seed, tiny.name, transformers.__version__], sort_keys=True)
    target = cache / "random" / f"{name}-seed{seed}-{hashlib.sha1(key.encode()).hexdigest()[:10]}"
    if build_once(target, lambda folder: _write_folder(folder, name, shape, seed, tiny)):
        logger.info("wrote random:%s (seed %d, tiny tokenizer of %s) to %s", name, seed, tiny.name, target)
    return target


def _write_folder(folder: Path, name: str, shape: dict[str, Any], seed: int, tiny: Path) -> None:
    from transformers import AutoConfig

    settings = with_token_ids(shape, json.loads((tiny / "config.json").read_text()))
    model_type = settings.pop("model_type")
    config = AutoConfig.for_model(model_type, **settings)
    config.architectures = [model_class_for(model_type).__name__]  # what vLLM picks its model class by
    folder.mkdir(parents=True)
    config.save_pretrained(folder)
    for file in tiny.iterdir():  # tokenizer, chat template, image processor, generation config
        if file.is_file() and file.name != "config.json" and not file.name.endswith(WEIGHT_SUFFIXES):
            shutil.copy2(file, folder / file.name)
    (folder / MARKER).write_text(json.dumps({"name": name, "seed": seed, "tokenizer": tiny.name}, indent=2) + "\n")


def with_token_ids(shape: dict[str, Any], tiny_config: dict[str, Any]) -> dict[str, Any]:
    """``shape`` with the special-token ids (image, video, vision start/end, bos, eos, pad) of the tiny model's
    config, at the same level (top or ``text_config``) as there."""
    out = copy.deepcopy(shape)
    out.update({k: v for k, v in tiny_config.items() if k.endswith(TOKEN_ID_KEYS)})
    if "text_config" in out:
        tiny_text = tiny_config["text_config"]  # a VL shape pairs with the VL tiny model, which nests it too
        out["text_config"].update({k: v for k, v in tiny_text.items() if k.endswith(TOKEN_ID_KEYS)})
    return out


def is_random_folder(folder: Union[str, Path]) -> bool:
    """Whether ``folder`` is a random: folder (no weights to read)."""
    return (Path(folder) / MARKER).is_file()


def random_model(folder: Union[str, Path], dtype: torch.dtype, attn_implementation: str,
                 device: Union[str, torch.device] = "cpu") -> Any:
    """The architecture of the random: ``folder``, initialised by transformers (its ``_init_weights``: normal
    weights with the config's ``initializer_range``, unit norms, rotary frequencies recomputed) on ``device``,
    seeded from the folder's seed; in eval mode, as ``from_pretrained`` returns it."""
    from transformers import AutoConfig, GenerationConfig

    folder = Path(folder)
    marker = json.loads((folder / MARKER).read_text())
    config = AutoConfig.from_pretrained(folder)
    cls = model_class_for(config.model_type)
    with torch.device("meta"):
        model = cls._from_config(config, dtype=dtype, attn_implementation=attn_implementation)  # noqa: SLF001
    model.generation_config = GenerationConfig.from_pretrained(folder)
    device = torch.device(device)
    model.to_empty(device=device)  # storage on the device, uninitialised; this unties shared weights
    model.tie_weights()  # before initialising: a tied weight is initialised once
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):  # the caller's random state stays as it was
        torch.manual_seed(marker["seed"])  # CPU and every GPU
        model.initialize_weights()  # every module, non-persistent buffers (rotary inv_freq) included
    model.eval()
    logger.info("random:%s: %.2fB parameters initialised on %s in %s", marker["name"],
                sum(p.numel() for p in model.parameters()) / 1e9, device, dtype)
    return model
