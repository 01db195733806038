"""Export a checkpoint as a Hugging Face folder: ``easytrain export CKPT --out DIR [--merge]``.

The model is rebuilt on CPU from the checkpoint's own ``config.yaml`` (same
base model, same LoRA settings), the actor's DCP shards (or, for
``worker.actor.strategy=deepspeed``, its ZeRO checkpoint) are loaded into it in
one process (whatever number of ranks saved them), and ``save_pretrained``
writes safetensors with the config, tokenizer, image processor and chat
template beside them. With LoRA the folder holds the adapter in PEFT's format
(load it with ``PeftModel.from_pretrained(base, DIR)``); ``--merge`` folds the
adapter into the base weights and writes a plain model instead. The folder is
written under a temporary name and renamed when complete.

A checkpoint is data from whoever wrote it: its tensors are read weights-only
and its DCP index with a restricted unpickler (easytrain.distributed.checkpoint),
and ``model.trust_remote_code`` is never taken from its ``config.yaml``: only
``--trust-remote-code`` on this command runs the base model's own code.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any, Optional

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from easytrain.config.schema import Config
from easytrain.distributed.checkpoint import IncompatibleCheckpoint, load_model_weights, read_json, write_json
from easytrain.memory import peaks
from easytrain.trainer.checkpoint import ACTOR, CONFIG_FILE, STATE_FILE, checkpoint_folder

logger = logging.getLogger(__name__)

PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json",
                   "chat_template.json", "chat_template.jinja")
"""Files of the base model's processor copied as they are when save_pretrained did not write them."""


def checkpoint_config(folder: Path, trust_remote_code: bool = False) -> Config:
    """The run config a checkpoint was written with, except ``model.trust_remote_code``: that is
    ``trust_remote_code`` (this command's choice), whatever the checkpoint says, so that a checkpoint from
    elsewhere cannot make the export run its base model's Python code."""
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise ExportError(f"{path}: missing; a checkpoint written by easytrain holds the run's config there, and "
                          "the export rebuilds the model from it")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(path))
        config = OmegaConf.to_object(merged)
    except (OmegaConfBaseException, yaml.YAMLError) as err:
        key = getattr(err, "full_key", None)
        what = (str(err).strip().splitlines() or [type(err).__name__])[0].strip()
        raise ExportError(f"{path}: does not fit this easytrain's config ({f'{key}: ' if key else ''}{what}); "
                          "export with the easytrain version that wrote the checkpoint, or fix that key in the "
                          "file") from None
    assert isinstance(config, Config)
    if config.model.trust_remote_code and not trust_remote_code:
        logger.warning("%s sets model.trust_remote_code=true; ignored (it would run code shipped with the model): "
                       "pass --trust-remote-code if you trust %s", path, config.model.path)
    config.model.trust_remote_code = trust_remote_code
    return config


def one_line(err: BaseException) -> str:
    """An error's message on one line (transformers' and OmegaConf's span several)."""
    return " ".join(str(err).split()) or type(err).__name__


def load_actor_weights(actor: Path, config: Config, model: Any) -> None:
    """The actor's trained weights into ``model`` (one process): DCP shards, or a DeepSpeed ZeRO checkpoint
    consolidated by DeepSpeed's zero_to_fp32 when the run used ``worker.actor.strategy=deepspeed``."""
    if config.worker.actor.strategy != "deepspeed":
        load_model_weights(actor, model)
        return
    from easytrain.distributed.deepspeed import deepspeed_state_dict

    state = deepspeed_state_dict(actor)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise IncompatibleCheckpoint(f"{actor}: the DeepSpeed checkpoint does not fit the model built from its "
                                     f"config ({len(missing)} tensor(s) missing, e.g. {missing[:1]}; "
                                     f"{len(unexpected)} unexpected, e.g. {unexpected[:1]})")


MARKER = "easytrain_export.json"
"""Written into every export: a folder holding it may be replaced by the next export. Besides where the export came
from it records ``peak_host_bytes``, the export process's resident-set high-water mark when everything is written
(``VmHWM``: this process's own, unlike ``ru_maxrss``, which after ``exec`` starts from the parent's high-water
mark; 0 where /proc does not say), the figure the plan's ``export`` row prices."""


class ExportError(ValueError):
    """An ``--out`` that the export must not write to; one line for the user."""


def check_out(out: str | Path, checkpoint: Path, force: bool = False) -> Path:
    """``out`` made absolute, or an :class:`ExportError` when writing it could lose data: it is or holds the
    checkpoint (its run), lies inside the checkpoint, holds the current directory, is a file, or is a non-empty
    folder that holds no earlier export (allowed with ``force``)."""
    target = Path(out).expanduser().resolve()
    source = checkpoint.expanduser().resolve()
    if target == source or target in source.parents:
        raise ExportError(f"--out {target}: it holds the checkpoint being exported ({source}); replacing it would "
                          "delete the run: choose a folder outside the run")
    if source in target.parents:
        raise ExportError(f"--out {target}: inside the checkpoint {source}; choose a folder outside the run")
    if target == Path.cwd().resolve() or target in Path.cwd().resolve().parents:
        raise ExportError(f"--out {target}: it holds the current directory; choose a new folder")
    if target.exists() and not target.is_dir():
        raise ExportError(f"--out {target}: a file is there; choose a folder")
    if target.is_dir() and any(target.iterdir()) and not (target / MARKER).is_file() and not force:
        raise ExportError(f"--out {target}: not empty and no earlier export (no {MARKER}); give a new or empty "
                          "folder, or --force to replace what is there")
    return target


def export(checkpoint: str | Path, out: str | Path, merge: bool = False, dtype: Optional[str] = None,
           force: bool = False, trust_remote_code: bool = False) -> Path:
    """Write the checkpoint's actor as a ``from_pretrained`` folder at ``out`` (replacing an earlier export there;
    see :func:`check_out` for what is refused); returns ``out``. ``trust_remote_code`` is the caller's choice
    (see :func:`checkpoint_config`)."""
    import torch

    from easytrain.models.hf import load_image_processor, load_model, load_tokenizer, model_folder
    from easytrain.models.parts import apply_lora

    folder = checkpoint_folder(checkpoint)
    out = check_out(out, folder, force)  # before the model is loaded: a refusal costs nothing
    config = checkpoint_config(folder, trust_remote_code)
    lora = config.model.lora.rank > 0
    if merge and not lora:
        logger.info("--merge: the checkpoint has no LoRA adapter; exporting the full model")
    source = model_folder(config.model)
    model = load_model(config.model, source, dtype="float32")
    if lora:
        model = apply_lora(model, config.model.lora)
    load_actor_weights(folder / ACTOR, config, model)
    if lora and merge:
        model = model.merge_and_unload()
    if dtype is not None:
        model = model.to(getattr(torch, dtype))
    tmp = out.with_name(f".tmp_{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    load_tokenizer(config.model, source).save_pretrained(tmp)
    processor = load_image_processor(config.model, source)
    if processor is not None:
        processor.save_pretrained(tmp)
    for name in PROCESSOR_FILES:
        if (Path(source) / name).is_file() and not (tmp / name).exists():
            shutil.copy(Path(source) / name, tmp / name)
    step = read_json(folder / STATE_FILE)["step"]
    peak = peaks.host_high_water()
    write_json(tmp / MARKER, {"checkpoint": str(folder), "step": step, "base_model": source,
                              "lora_adapter": lora and not merge, "merged": lora and merge, "peak_host_bytes": peak})
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    kind = "LoRA adapter" if lora and not merge else "model"
    logger.info("exported the %s of %s (step %d) to %s (peak host memory %.2f GB)", kind, folder, step, out, peak / 1e9)
    return out
