"""Step metrics on the Ray dashboard: every logged metric as a ``ray.util.metrics`` gauge.

Ray exports application metrics through each node's metrics agent to
Prometheus, and the dashboard's metrics view reads them from there. Names are
``easytrain_<key>`` with the key's ``/`` and other characters Prometheus does
not allow turned into ``_`` (``reward/mean`` -> ``easytrain_reward_mean``),
tagged with the run (``trainer.experiment_name``). Per-worker memory from the
watchdog's in-worker readings goes to ``easytrain_worker_rss_bytes`` (and the
torch allocator's figures on GPU) tagged with role, rank and node; a counter
``easytrain_steps`` counts logged training steps.
"""

from __future__ import annotations

import re
from typing import Any


WORKER_KEYS = ("rss_bytes", "gpu_allocated_bytes", "gpu_reserved_bytes", "gpu_peak_bytes")


def metric_name(key: str) -> str:
    name = re.sub(r"[^a-zA-Z0-9_]", "_", key)
    return f"easytrain_{name}"


class RayMetrics:
    """A metrics sink (``log``/``close``) that sets Ray gauges; a no-op outside a Ray driver or worker."""

    def __init__(self, run_name: str) -> None:
        from ray.util import metrics

        self._metrics, self.run = metrics, run_name
        self.gauges: dict[str, Any] = {}
        self.steps = metrics.Counter("easytrain_steps", "training steps logged", tag_keys=("run",))

    def _gauge(self, name: str, description: str, tag_keys: tuple[str, ...] = ("run",)) -> Any:
        if name not in self.gauges:
            self.gauges[name] = self._metrics.Gauge(name, description, tag_keys=tag_keys)
        return self.gauges[name]

    def log(self, step: int, metrics: dict[str, float]) -> None:
        tags = {"run": self.run}
        self._gauge("easytrain_step", "the step of the last logged metrics").set(step, tags)
        for key, value in metrics.items():
            self._gauge(metric_name(key), f"easytrain metric {key}").set(float(value), tags)
        if any(not key.startswith("val/") for key in metrics):
            self.steps.inc(1.0, tags)

    def workers(self, readings: list[dict[str, Any]]) -> None:
        """The in-worker memory readings the trainer collects each step (role, rank, node_ip, bytes)."""
        for reading in readings:
            tags = {"run": self.run, "role": str(reading.get("role")), "rank": str(reading.get("rank")),
                    "node": str(reading.get("node_ip"))}
            for key in WORKER_KEYS:
                if reading.get(key) is not None:
                    gauge = self._gauge(f"easytrain_worker_{key}", f"per-worker {key} (watchdog reading)",
                                        ("run", "role", "rank", "node"))
                    gauge.set(float(reading[key]), tags)

    def close(self) -> None:
        """Nothing to flush: Ray's metrics agent exports on its own period."""
