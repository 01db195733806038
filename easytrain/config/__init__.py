"""Typed config: the schema (dataclasses), Hydra composition and validation."""

from easytrain.config.loader import (CONF_DIR, DEFAULT_PRESET, compose, load, register_schema, schema_keys,
                                     to_config, with_default_preset)
from easytrain.config.schema import Config
from easytrain.config.validate import ConfigError, ModelShape, validate, world_size

__all__ = [
    "CONF_DIR", "DEFAULT_PRESET", "Config", "ConfigError", "ModelShape", "compose", "load", "register_schema",
    "schema_keys", "to_config", "validate", "with_default_preset", "world_size",
]
