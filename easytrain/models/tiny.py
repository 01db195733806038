"""Tiny random-initialised models for tests and the default run.

``build_tiny(<model_type>, "tiny", seed=0)`` builds, deterministically from
the seed, a real transformers model of a family with a tiny adapter
(:data:`easytrain.models.families.TINY_FAMILIES`) with a byte-level BPE
tokenizer trained here (the family's special tokens and chat template, from
its adapter) and, for the VL families, the family's image processor; it saves them with
``save_pretrained`` into a cache folder and returns the folder, which then
loads through the same ``from_pretrained`` path as a real checkpoint.

Sizes: ``tiny`` (~0.2M parameters, overhead-bound) and ``small`` (~4M: text
hidden 256, 4 layers, head_dim 64; vision depth 4, hidden 128), where compute
starts to dominate. Head dims stay >= 32 because vLLM's CPU attention rejects 16.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

from easytrain.models.families import ADAPTERS, TINY_FAMILIES, TinySpec, adapter_class

logger = logging.getLogger(__name__)

FAMILIES = TINY_FAMILIES
SIZES = ("tiny", "small")
FACTORY_VERSION = 4
"""Bump when the build changes, so cached folders from older builds are not reused."""

VOCAB_SIZE = 1024
SPECIAL_TOKENS = ADAPTERS[0].tiny_tokens
"""The default family's special tokens (the first ids of its tiny vocabulary)."""

SPECS = {
    "tiny": TinySpec(hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128,
                     vision_depth=2, vision_hidden=32, vision_heads=1, vision_intermediate=64, vocab=VOCAB_SIZE),
    "small": TinySpec(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=704,
                      vision_depth=4, vision_hidden=128, vision_heads=2, vision_intermediate=256, vocab=VOCAB_SIZE),
}


def _check(family: str, size: str) -> TinySpec:
    if family not in FAMILIES:
        raise ValueError(f"unknown tiny model family {family!r}; use one of {', '.join(FAMILIES)}")
    if size not in SPECS:
        raise ValueError(f"unknown tiny model size {size!r}; use one of {', '.join(SIZES)}")
    return SPECS[size]


def tiny_hf_config(family: str, size: str = "tiny", token_ids: Optional[dict[str, int]] = None) -> dict[str, Any]:
    """The HF config dict of a tiny model (shape only unless ``token_ids`` are given)."""
    spec = _check(family, size)
    return adapter_class(family).tiny_config(spec, token_ids or {})


# ----------------------------------------------------------------------------- tokenizer


_WORDS = (
    "how many what which is are the a an of in on there image picture shown count shapes shape "
    "circle circles square squares triangle triangles red green blue yellow purple orange black white "
    "largest smallest bigger smaller more fewer than left right top bottom color colour answer final "
    "think reasoning so therefore because total number each and or not yes no describe look at "
    "user assistant system you helpful please step by first then"
).split()


def _corpus(seed: int, lines: int = 3000) -> list[str]:
    """Deterministic text the BPE learns its merges from: task words, digits, markup."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
        words.insert(rng.randrange(len(words)), str(rng.randint(0, 120)))
        sentence = " ".join(words).capitalize() + rng.choice([".", "?", "!", ":"])
        style = rng.random()
        if style < 0.2:
            sentence = f"<think>{sentence}</think> The answer is \\boxed{{{rng.randint(0, 20)}}}."
        elif style < 0.3:
            sentence = f"Answer: {rng.choice(_WORDS)}\n{sentence}"
        out.append(sentence)
    return out


def build_tokenizer(seed: int = 0, family: str = TINY_FAMILIES[0], special_tokens: Optional[Sequence[str]] = None,
                    chat_template: Optional[str] = None) -> Any:
    """A byte-level BPE tokenizer with the family's special tokens and chat template (ChatML turns);
    ``special_tokens`` / ``chat_template``, where given, in their place (a tiny model of a family without an
    adapter of its own, built by a test: ``<|im_end|>`` and ``<|endoftext|>`` among the tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    adapter = adapter_class(family)
    specials = tuple(adapter.tiny_tokens if special_tokens is None else special_tokens)
    template = adapter.tiny_template if chat_template is None else chat_template
    named = dict(adapter.tiny_named_tokens) if special_tokens is None else {}
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=list(specials), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(_corpus(seed), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=[t for t in specials if t not in ("<|im_end|>", "<|endoftext|>")],
        chat_template=template, model_max_length=4096, padding_side="left",
        **({"model_specific_special_tokens": named} if named else {}),
    )


# ----------------------------------------------------------------------------- build


def default_cache_dir() -> Path:
    return Path(os.path.expanduser("~/.cache/easytrain"))


def tiny_folder_name(family: str, size: str, seed: int) -> str:
    """Folder name: family, size, seed and a fingerprint of everything that shapes the build."""
    import transformers

    spec = _check(family, size)
    key = json.dumps([FACTORY_VERSION, family, asdict(spec), seed, VOCAB_SIZE, transformers.__version__])
    return f"{family}-{size}-seed{seed}-{hashlib.sha1(key.encode()).hexdigest()[:10]}"


def build_tiny(family: str, size: str = "tiny", seed: int = 0,
               cache_dir: Union[str, Path, None] = None) -> Path:
    """Build (or reuse from the cache) a tiny model folder and return its path.

    Safe to call from several processes at once: each builds into its own
    temporary folder and the first atomic rename wins.
    """
    cache = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    target = cache / "tiny" / tiny_folder_name(family, size, seed)
    if build_once(target, lambda folder: _build_into(folder, family, size, seed)):
        logger.info("built tiny %s (%s, seed %d) in %s", family, size, seed, target)
    return target


def build_once(target: Path, fill: Callable[[Path], None]) -> bool:
    """Make the cache folder ``target`` (done once it holds a config.json) with ``fill(folder)``, which creates
    and fills ``folder``. Safe from several processes at once: each fills its own temporary folder and the first
    atomic rename wins. True when this call built it."""
    if (target / "config.json").is_file():
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    try:
        fill(tmp)
        if not (tmp / "config.json").is_file():
            raise RuntimeError(f"building {target.name} wrote no config.json into {tmp}")
        try:
            os.rename(tmp, target)
            return True
        except OSError:  # another process finished first (its folder is equivalent), or a damaged folder is there
            if (target / "config.json").is_file():
                return False
        logger.warning("the cached folder %s has no config.json (damaged): building it again", target)
        stale = target.parent / f".{target.name}.stale.{uuid.uuid4().hex[:8]}"
        try:
            os.rename(target, stale)
        except OSError:  # another process moved it first
            pass
        shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(tmp, target)
            return True
        except OSError:
            return False
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _build_into(folder: Path, family: str, size: str, seed: int) -> None:
    import torch
    import transformers

    tokenizer = build_tokenizer(seed, family)
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in adapter_class(family).tiny_tokens}
    raw = tiny_hf_config(family, size, ids)
    model_type = raw.pop("model_type")
    config = transformers.AutoConfig.for_model(model_type, **raw)
    model_class = model_class_for(family)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config).to(torch.float32)
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    folder.mkdir(parents=True)
    # transformers writes a model only on torch.distributed rank 0 when a process group is up; the cache folder
    # is this process's own, whatever its rank (a rank-1 build would otherwise publish a folder without weights)
    model.should_save_on_this_rank = lambda is_main_process: True
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    processor = adapter_class(family).tiny_processor()
    if processor is not None:
        processor.save_pretrained(folder)
    if adapter_class(family).tiny_processor_config:
        (folder / "processor_config.json").write_text(json.dumps(adapter_class(family).tiny_processor_config))


def model_class_for(family: str) -> Any:
    """The transformers class for a model family (what ``from_pretrained`` is called on)."""
    return adapter_class(family)({"model_type": family}).model_class()


def count_parameters(folder: Union[str, Path]) -> int:
    """Parameters stored in a saved model folder (read from the safetensors header, no load)."""
    from safetensors import safe_open

    total = 0
    for file in Path(folder).glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                shape = f.get_slice(name).get_shape()
                n = 1
                for d in shape:
                    n *= d
                total += n
    return total
