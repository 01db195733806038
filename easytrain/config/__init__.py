"""Typed config: the schema (dataclasses), Hydra composition and validation, and the facts derived from a config."""

from easytrain.config.loader import (CONF_DIR, DEFAULT_PRESET, compose, load, register_schema, schema_keys,
                                     to_config, with_default_preset, with_overrides)
from easytrain.config.derived import world_size
from easytrain.config.errors import ConfigError
from easytrain.config.schema import Config
from easytrain.config.validate import ModelShape, validate

__all__ = [
    "CONF_DIR", "DEFAULT_PRESET", "Config", "ConfigError", "ModelShape", "compose", "load", "register_schema",
    "schema_keys", "to_config", "validate", "with_default_preset", "with_overrides", "world_size",
]
