"""Typed config: the schema (dataclasses), Hydra composition and validation."""

from easytrain.config.loader import CONF_DIR, compose, load, register_schema, schema_keys, to_config
from easytrain.config.schema import Config
from easytrain.config.validate import ConfigError, ModelShape, validate, world_size

__all__ = [
    "CONF_DIR", "Config", "ConfigError", "ModelShape", "compose", "load", "register_schema",
    "schema_keys", "to_config", "validate", "world_size",
]
