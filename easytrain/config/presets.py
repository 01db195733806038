"""``conf/model/``: the shapes of public checkpoints, one YAML file each, and the ``random:<name>`` models.

Each file holds a ``hub_id`` and the shape settings of that checkpoint's published ``config.json``
(``hf_config``). They are part of the config tree: validation checks a ``model.path=random:<name>`` against the
file names here, and :mod:`easytrain.models.shapes` reads model shapes from them without a download.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from easytrain.config.errors import ConfigError

RANDOM_PREFIX = "random:"
"""``model.path=random:<name>``: the shape of ``conf/model/<name>.yaml`` with random weights (models/random_init.py)."""
MODEL_CONF_DIR = Path(__file__).resolve().parents[2] / "conf" / "model"
"""Full HF configs (shape settings) of public checkpoints, one YAML file each, keyed by ``hub_id``."""


def model_presets() -> dict[str, dict[str, Any]]:
    """``conf/model/`` file stem -> its entry (``hub_id`` and ``hf_config``)."""
    import yaml

    return {path.stem: yaml.safe_load(path.read_text()) for path in sorted(MODEL_CONF_DIR.glob("*.yaml"))}


def known_hf_configs() -> dict[str, dict[str, Any]]:
    """hub id -> the shape settings of its public ``config.json`` (from ``conf/model/``)."""
    return {entry["hub_id"]: entry["hf_config"] for entry in model_presets().values()}


def random_hf_config(path: str) -> dict[str, Any]:
    """The shape settings ``model.path=random:<name>`` builds: ``conf/model/<name>.yaml``'s ``hf_config``; an
    unknown name is a config error naming ``model.path`` and the valid names."""
    presets = model_presets()
    name = path[len(RANDOM_PREFIX):]
    if name not in presets:
        raise ConfigError("model.path", path, "unknown random: model (the names are conf/model/'s files)",
                          "use one of " + ", ".join(RANDOM_PREFIX + known for known in presets))
    return dict(presets[name]["hf_config"])
