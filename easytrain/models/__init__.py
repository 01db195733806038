"""Models: loading (local path, hub id, tiny:<family>), the tiny-model factory, known shapes."""
