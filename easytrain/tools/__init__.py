"""Tools for multi-turn rollouts: loading user functions with their JSON schemas, parsing the calls a model
emits, and running each call in a separate process with a timeout and a size limit on its output.

``worker.rollout.multi_turn.tools`` names Python functions like ``reward.function`` does
(``path/to/file.py:name`` or ``package.module:name``). A tool that raises, hangs or dies gives its sample an
error turn and a counted failure, never a dead run.
"""
