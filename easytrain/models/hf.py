"""Loading models, tokenizers and image processors through transformers.

One place turns ``model.path`` into a folder (building a tiny model when the
path is ``tiny:<family>``, a weightless real-shaped one for ``random:<name>``)
and loads from it with ``from_pretrained``, so tiny models and real
checkpoints take the same path; a random: folder's weights are initialised in
place instead (models/random_init.py).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional

from easytrain.config.errors import ConfigError
from easytrain.config.presets import RANDOM_PREFIX
from easytrain.config.schema import ModelConfig
from easytrain.models.families import Family, family_of_folder
from easytrain.models.tiny import build_tiny


DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def model_folder(model: ModelConfig) -> str:
    """A folder or hub id ``from_pretrained`` can load; builds tiny models into the cache."""
    if model.path.startswith("tiny:"):
        return str(build_tiny(model.path[5:], model.tiny_size, model.tiny_seed, model.cache_dir))
    if model.path.startswith(RANDOM_PREFIX):
        from easytrain.models.random_init import build_random

        return str(build_random(model.path[len(RANDOM_PREFIX):], model.tiny_seed, model.cache_dir))
    return model.path


@contextmanager
def loading(key: str, path: str, what: str) -> Iterator[None]:
    """Any error loading ``what`` from ``path`` becomes a one-line :class:`ConfigError` naming ``key`` (a missing
    or partial folder, a hub id that does not exist or cannot be reached, an unknown architecture)."""
    try:
        yield
    except ConfigError:
        raise
    except Exception as err:  # transformers raises OSError, ValueError, KeyError, json and safetensors errors
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise ConfigError(key, path, f"the {what} could not be loaded ({type(err).__name__}: {first[:300]})",
                          "give a Hugging Face model folder (config.json, tokenizer and weights) or a hub id this "
                          "machine can download") from err


def family(folder: str, key: str = "model.path") -> Family:
    """The family adapter of a model folder or hub id (:mod:`easytrain.models.families`)."""
    with loading(key, folder, "model config"):
        return family_of_folder(folder)


def load_tokenizer(model: ModelConfig, folder: Optional[str] = None) -> Any:
    from transformers import AutoTokenizer

    source = model.tokenizer_path or folder or model_folder(model)
    with loading("model.tokenizer_path" if model.tokenizer_path else "model.path", source, "tokenizer"):
        return AutoTokenizer.from_pretrained(source, trust_remote_code=model.trust_remote_code)


def load_image_processor(model: ModelConfig, folder: Optional[str] = None) -> Any:
    """The family's image processor (see :meth:`Family.image_processor`); None for text-only models."""
    folder = folder or model_folder(model)
    adapter = family(folder)
    if not adapter.vision:
        return None
    source = model.tokenizer_path or folder
    with loading("model.tokenizer_path" if model.tokenizer_path else "model.path", source, "image processor"):
        return adapter.image_processor(source)


def load_model(model: ModelConfig, folder: Optional[str] = None, device: str = "cpu",
               dtype: Optional[str] = None) -> Any:
    """The transformers model of ``model.path`` in ``dtype`` (default ``model.dtype``) with the configured attention."""
    import torch

    from easytrain.models.random_init import is_random_folder, random_model

    folder = folder or model_folder(model)
    torch_dtype = getattr(torch, DTYPES[dtype or model.dtype])
    if is_random_folder(folder):  # no weights to read: built and initialised on the device itself
        return random_model(folder, torch_dtype, model.attn_implementation, device)
    with loading("model.path", folder, "model"):
        cls = family(folder).model_class()
        loaded = cls.from_pretrained(
            folder, dtype=torch_dtype, attn_implementation=model.attn_implementation,
            trust_remote_code=model.trust_remote_code,
        )
    return loaded.to(device)
