"""Models: loading (local path, hub id, tiny:<family>, random:<name>), the tiny-model factory, real-shaped random
models, known shapes."""
