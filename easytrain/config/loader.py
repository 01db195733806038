"""Compose Hydra configs onto the schema and turn them into validated dataclasses.

``compose(overrides)`` is what the CLI and tests use; ``python -m
easytrain.main`` composes through ``@hydra.main`` and then calls
:func:`to_config` on the result, so both paths validate identically.
Composition errors (unknown keys, wrong types, unknown presets) are turned into
:class:`ConfigError` with one line naming the key.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence

from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    InterpolationResolutionError,
    MissingMandatoryValue,
    OmegaConfBaseException,
)

from easytrain.config.errors import NO_VALUE, ConfigError
from easytrain.config.fields import freeze
from easytrain.config.schema import Config
from easytrain.config.validate import ModelShape, validate

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
"""The YAML tree (``conf/`` at the repository root)."""
SCHEMA_NAME = "easytrain_schema"
PRIMARY = "config"
DEFAULT_PRESET = "tiny"
"""The experiment preset used when the command line names none."""


def with_default_preset(overrides: Sequence[str]) -> list[str]:
    """``overrides`` plus ``+exp=tiny`` when no ``exp`` preset is chosen.

    The preset is not in ``config.yaml``'s defaults list because Hydra then
    refuses ``+exp=...`` (a group already in the list cannot be added again);
    adding it here keeps ``python -m easytrain.main`` and ``+exp=tiny`` the same run.
    """
    chosen = any(o.lstrip("+~").split("=", 1)[0] == "exp" for o in overrides)
    return list(overrides) if chosen else [f"+exp={DEFAULT_PRESET}", *overrides]


def register_schema() -> None:
    """Register the schema with Hydra's ConfigStore (``conf/config.yaml`` lists it first), once per process:
    storing it builds the whole structured config (~0.1 s)."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    if f"{SCHEMA_NAME}.yaml" not in store.repo:
        store.store(name=SCHEMA_NAME, node=Config)


def compose(overrides: Sequence[str] = ()) -> DictConfig:
    """Compose ``conf/config.yaml`` with command-line style overrides (no validation yet)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if not (CONF_DIR / f"{PRIMARY}.yaml").is_file():
        raise ConfigError("conf", str(CONF_DIR), "the config folder is missing",
                          "run from a checkout of easytrain (pip install -e .)")
    register_schema()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(str(CONF_DIR), version_base="1.3", job_name="easytrain"):
            return hydra_compose(PRIMARY, overrides=list(overrides), return_hydra_config=True)
    except Exception as err:  # Hydra raises several unrelated types; all become one line
        raise explain(err) from err
    finally:
        GlobalHydra.instance().clear()


def to_config(cfg: DictConfig, shape: Optional[ModelShape] = None) -> Config:
    """Convert a composed DictConfig into the typed :class:`Config` and validate it."""
    cfg = cfg.copy()
    hydra_node = None
    if "hydra" in cfg:
        with open_dict(cfg):
            hydra_node = cfg.pop("hydra")
    _fill_output_dir(cfg, hydra_node)
    try:
        obj = OmegaConf.to_object(cfg)
    except Exception as err:
        raise explain(err) from err
    assert isinstance(obj, Config), type(obj)
    validate(obj, shape)  # (resolves the auto values)
    freeze(obj)
    return obj


def with_overrides(config: Config, overrides: Mapping[str, Any]) -> Config:
    """A read-only copy of ``config`` with dotted keys set, not validated again (the planner's what-ifs; the
    run's own config never changes)."""
    out = copy.deepcopy(config)
    freeze(out, False)
    for key, value in overrides.items():
        *path, last = key.split(".")
        node: Any = out
        for part in path:
            node = getattr(node, part)
        setattr(node, last, value)
    freeze(out)
    return out


def load(overrides: Sequence[str] = (), shape: Optional[ModelShape] = None) -> Config:
    """compose + to_config."""
    return to_config(compose(overrides), shape)


def _fill_output_dir(cfg: DictConfig, hydra_node: Any) -> None:
    """``trainer.output_dir`` defaults to Hydra's run folder; outside a Hydra run use ``hydra.run.dir``."""
    try:
        OmegaConf.select(cfg, "trainer.output_dir", throw_on_resolution_failure=True)
        value = cfg.trainer.output_dir
        if value is not None and value != "???":
            return
    except (InterpolationResolutionError, MissingMandatoryValue, ValueError):
        pass
    run_dir = "outputs/easytrain"
    if hydra_node is not None:
        try:
            run_dir = str(hydra_node.run.dir)
        except OmegaConfBaseException:
            pass
    cfg.trainer.output_dir = run_dir


# ----------------------------------------------------------------------------- errors


def explain(err: BaseException) -> ConfigError:
    """Turn a Hydra/OmegaConf error into a one-line :class:`ConfigError`."""
    for cause in _chain(err):
        if isinstance(cause, ConfigError):
            return cause
    for cause in _chain(err):
        if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and getattr(cause, "full_key", None):
            key = str(cause.full_key)
            hint = _suggest(key)
            fix = f"did you mean {hint}?" if hint else "see `easytrain config` for the valid keys"
            return ConfigError(key, NO_VALUE, "unknown config key", fix)
        if isinstance(cause, OmegaConfBaseException) and getattr(cause, "full_key", None):
            msg = str(getattr(cause, "msg", cause)).strip().splitlines()[0]
            return ConfigError(str(cause.full_key), NO_VALUE, msg)
    options = getattr(err, "options", None)
    missing = getattr(err, "missing_cfg_file", None)
    if missing and options:
        group = str(missing).rsplit("/", 1)[0]
        return ConfigError(group, str(missing).rsplit("/", 1)[-1], f"no such preset in conf/{group}/",
                           f"use one of {', '.join(sorted(options))}")
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    lines = [line for line in lines if "HYDRA_FULL_ERROR" not in line]
    if "Config search path:" in lines:
        lines = lines[: lines.index("Config search path:")]
    text = "; ".join(lines) if lines else type(err).__name__
    return ConfigError("overrides", NO_VALUE, text.replace("\t", ""))


def _chain(err: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: Optional[BaseException] = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def schema_keys(obj: Any = Config, prefix: str = "") -> list[str]:
    """Every dotted key of the schema (used for suggestions and docs)."""
    keys = []
    for f in dataclasses.fields(obj):
        key = prefix + f.name
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            keys.extend(schema_keys(type(default), key + "."))
        else:
            keys.append(key)
    return keys


def _suggest(key: str) -> Optional[str]:
    keys = schema_keys()
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
    if close:
        return close[0]
    leaf = key.rsplit(".", 1)[-1]
    same_leaf = [k for k in keys if k.rsplit(".", 1)[-1] == leaf]
    return same_leaf[0] if same_leaf else None
