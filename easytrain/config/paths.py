"""Checks of the files and folders a config names, on the machine that runs the driver.

They run where the run starts (``easytrain run``, ``python -m easytrain.main``,
``easytrain config``), before Ray or a tokenizer: a wrong ``model.path`` or a
missing data file is one line naming the key, not a traceback minutes later.
``easytrain submit`` skips them: a cluster's paths (a shared volume, a pod's
mount) need not exist on the machine that submits, and the job's driver runs
them again where the files must be.
"""

from __future__ import annotations

import json
import os

from easytrain.config.data_spec import classify_data, parse_task, split_files
from easytrain.config.errors import ConfigError
from easytrain.config.presets import RANDOM_PREFIX
from easytrain.config.schema import Config

BUILT_PREFIXES = ("tiny:", RANDOM_PREFIX)
"""A ``model.path`` starting so is built here, neither read from a folder nor downloaded."""


def looks_local(path: str, on_disk: bool = True) -> bool:
    """Whether ``path`` names a place on disk rather than a hub id (``name`` or ``owner/name``): absolute,
    ``~``/``.``-relative, more than one ``/``, or (``on_disk``) something that exists here. ``on_disk=False``
    judges the text alone, for a path read on another machine (a pod's)."""
    if path.startswith(("/", "~", ".")) or (on_disk and os.path.exists(os.path.expanduser(path))):
        return True
    return path.count("/") > 1 or (os.sep != "/" and os.sep in path)


def check_local_paths(cfg: Config) -> None:
    """Raise :class:`ConfigError` for the first path key naming a file or folder that is not here."""
    _check_model_folder("model.path", cfg.model.path, needs_config=True)
    if cfg.model.tokenizer_path is not None:
        _check_model_folder("model.tokenizer_path", cfg.model.tokenizer_path, needs_config=False)
    for key, value in (("data.train_files", cfg.data.train_files), ("data.val_files", cfg.data.val_files)):
        for i, spec in enumerate(split_files(value)):
            _check_data_entry(key if isinstance(value, str) else f"{key}[{i}]", spec)
    image_dir = cfg.data.image_dir
    if image_dir is not None and not os.path.isdir(os.path.expanduser(image_dir)):
        raise ConfigError("data.image_dir", image_dir, "no such folder",
                          "give the folder relative image paths are read from, or null")
    prompt = cfg.data.format_prompt
    if prompt is not None and not os.path.isfile(os.path.expanduser(prompt)):
        raise ConfigError("data.format_prompt", prompt, "no such file",
                          "give the path of a Jinja template (it receives `content`)")
    spec = cfg.reward.function
    target = spec.rsplit(":", 1)[0] if ":" in spec else ""
    if target.endswith(".py") and not os.path.isfile(os.path.expanduser(target)):
        raise ConfigError("reward.function", spec, f"no such file {target!r}", "check the path")
    resume = cfg.trainer.resume
    if resume not in ("auto", "off") and not os.path.isdir(os.path.expanduser(resume)):
        raise ConfigError("trainer.resume", resume, "is neither auto, off nor an existing checkpoint folder",
                          "give <output_dir>/checkpoints/global_step_<N>, or auto/off")


def _check_model_folder(key: str, path: str, needs_config: bool) -> None:
    if path.startswith(BUILT_PREFIXES) or not looks_local(path):
        return  # built here, or a hub id (checked when it downloads)
    folder = os.path.expanduser(path)
    if not os.path.exists(folder):
        raise ConfigError(key, path, "no such folder",
                          "give a Hugging Face model folder (config.json and weights), a hub id (org/name), "
                          "or tiny:<model_type> (README: Model families)")
    if not os.path.isdir(folder):
        raise ConfigError(key, path, "is a file, not a model folder",
                          "give the folder that holds config.json (the one from_pretrained loads)")
    if not needs_config:
        return
    config_file = os.path.join(folder, "config.json")
    if not os.path.isfile(config_file):
        raise ConfigError(key, path, "holds no config.json, so it is not a Hugging Face model folder",
                          "give the folder that holds config.json and the weights (an exported run's --out folder)")
    try:
        with open(config_file, encoding="utf-8") as f:
            family = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError) as err:
        raise ConfigError(key, path, f"its config.json cannot be read ({type(err).__name__}: {err})",
                          "restore the file from where the model came from") from None
    if not isinstance(family, str) or not family:
        raise ConfigError(key, path, "its config.json names no model_type, so its architecture is unknown",
                          "restore the file from where the model came from")


def _check_data_entry(key: str, spec: str) -> None:
    entry = classify_data(spec)
    if entry.kind == "synthetic":
        try:
            parse_task(entry.target)
        except ValueError as err:
            raise ConfigError(key, spec, str(err).split(";")[0], str(err).split("; ", 1)[-1]) from None
    elif entry.kind == "unsupported":
        raise ConfigError(key, spec, f"unsupported file type {entry.suffix or '(none)'!r}",
                          "use .jsonl, .parquet or a saved dataset folder")
    elif entry.kind == "missing":
        raise ConfigError(key, spec, "no such file or folder",
                          "check the path (relative paths are read from the directory the run starts in); a hub "
                          "dataset is written repo@split")
    # a folder or a .jsonl/.parquet file is read when the run starts; a hub dataset is checked when it downloads
