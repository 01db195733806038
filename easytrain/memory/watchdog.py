"""The memory watchdog: a sampler on every node, and the driver's reading of what they saw.

Ray's memory monitor watches host RAM only and kills a worker at 95% of the
node; nothing watches GPU memory. easytrain samples both and acts first:

- :class:`NodeSampler`, one Ray actor per node (``num_cpus=0``, pinned to its
  node), reads every ``watchdog.sample_period_s`` the node's RAM (or its
  container's cgroup), the RSS of each easytrain process on it, and each GPU
  through NVML, and exports them as Ray metrics (the dashboard's Metrics
  view).
- :class:`Watchdog`, in the driver, drains the samplers at every step
  boundary into ``memory.jsonl``, together with the workers' own readings
  (the in-worker hook: RSS and the torch allocator), the step's phases and
  what it concluded: the highest level any node or GPU reached during the
  step (warn, soft, hard), ranks out of line with their role, and steady
  growth. What to do about it is the trainer's (``trainer/relief.py``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import ray

from easytrain.config.schema import Config
from easytrain.config.derived import ray_kill_threshold
from easytrain.memory.detect import MB, LeakDetector, RankMemory, gpu_pressure, imbalance, level, worst
from easytrain.memory.flag import GrowthRate, PressureFlag, hard_threshold
from easytrain.memory.readings import gpu_readings, node_ram, open_nvml, process_rss

logger = logging.getLogger(__name__)

GB = 2**30
MAX_BUFFERED = 200_000
"""Samples a sampler keeps between drains (a very long step at a short period); the oldest go first."""


def ram_where(node: dict[str, Any]) -> str:
    """How a node reading's RAM is named in a pressure line: the node's, or this run's share of it."""
    return f"node {node['node_ip']} RAM{' of this run' if node.get('scope') == 'run' else ''}"


def ram_line(node: dict[str, Any], lv: str, hard: float, configured: float) -> str:
    """A node reading at ``lv`` in one line: where, how full, which threshold (and, when growth lowered the
    hard one from ``configured`` to ``hard``, to what)."""
    why = (f", lowered to {hard:.1%} by growth of {node['ram_growth_per_s']:.1%}/s" if lv == "hard"
           and hard < configured else "")
    return (f"{ram_where(node)} at {node['ram_fraction']:.1%} ({node['ram_used_bytes'] / GB:.2f} of "
            f"{node['ram_limit_bytes'] / GB:.2f} GB, {lv} threshold{why})")


class NodeSampler:
    """Samples one node in a background thread; the driver drains what it recorded."""

    def __init__(self, node_id: str, period_s: float, limit_bytes: Optional[int], scope: str = "node",
                 thresholds: Optional[tuple[float, float, float]] = None) -> None:
        """``thresholds``: watchdog.ram_warn, ram_soft, ram_hard; with them every sample is judged here too and
        its level written to the node's pressure flag (:mod:`easytrain.memory.flag`)."""
        self.node_id, self.period_s, self.limit_bytes, self.scope = node_id, period_s, limit_bytes, scope
        self.thresholds = thresholds
        self.growth = GrowthRate(min_interval_s=min(period_s / 2, 0.1))
        self.flag = PressureFlag.of_this_job() if thresholds else None
        self.flagged: Optional[str] = None
        self.node_ip = ray.util.get_node_ip_address()
        self.processes: dict[int, tuple[str, int]] = {}
        self.buffer: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.judging = threading.Lock()
        """Orders the judgements (growth rate, flag) of samples taken in the loop and on the driver's call."""
        self.stopped = threading.Event()
        self.nvml = open_nvml()
        self.peak: dict[str, Any] = {}
        self.gauges = self._gauges()
        self.thread = threading.Thread(target=self._loop, name="easytrain-memory-sampler", daemon=True)
        self.thread.start()

    @staticmethod
    def _gauges() -> dict[str, Any]:
        from ray.util.metrics import Gauge

        return {"ram": Gauge("easytrain_node_ram_used_bytes", "Node RAM in use", tag_keys=("node_ip",)),
                "fraction": Gauge("easytrain_node_ram_fraction", "Node RAM used / limit", tag_keys=("node_ip",)),
                "rss": Gauge("easytrain_worker_rss_bytes", "RSS of an easytrain process",
                             tag_keys=("node_ip", "role", "rank")),
                "gpu": Gauge("easytrain_gpu_used_bytes", "GPU memory in use (NVML)", tag_keys=("node_ip", "gpu"))}

    def register(self, processes: list[tuple[int, str, int]]) -> None:
        """The easytrain processes on this node: (pid, role, rank); replaces the previous set."""
        with self.lock:
            self.processes = {pid: (role, rank) for pid, role, rank in processes}

    def sample(self) -> list[dict[str, Any]]:
        """One reading of the node, its processes and GPUs (also kept for :meth:`drain`)."""
        now = time.time()
        where = {"t": now, "node_id": self.node_id, "node_ip": self.node_ip}
        with self.lock:
            processes = dict(self.processes)
        records = []
        for pid, (role, rank) in processes.items():
            rss = process_rss(pid)
            if rss is not None:
                records.append({"kind": "process", **where, "role": role, "rank": rank, "pid": pid, "rss_bytes": rss})
        run_bytes = sum(r["rss_bytes"] for r in records) if self.scope == "run" else None
        records.insert(0, {**node_ram(self.limit_bytes, run_bytes=run_bytes), **where})
        with self.judging:  # the loop's samples and the driver's run in two threads: one judgement at a time
            self._judge(records[0])
        if self.nvml is not None:
            try:
                records.extend({**gpu, **where} for gpu in gpu_readings(self.nvml))
            except Exception:  # noqa: BLE001 - e.g. a GPU fell off the bus: keep watching RAM, say so once
                logger.exception("NVML reading failed on node %s; GPU sampling stops here", self.node_ip)
                self.nvml = None
        self._export(records)
        with self.lock:
            self.buffer.extend(records)
            del self.buffer[:-MAX_BUFFERED]
            if records[0]["ram_fraction"] >= self.peak.get("ram_fraction", -1.0):
                self.peak = dict(records[0])  # the highest node reading since the driver last asked (peak_since)
        return records

    def _judge(self, node: dict[str, Any]) -> None:
        """The hard threshold for this sample (lowered while RAM grows fast) and its level on the flag."""
        if self.thresholds is None:
            return
        warn, soft, hard = self.thresholds
        growth = self.growth.add(node["t"], node["ram_fraction"])
        # Ray's kill line in this reading's terms; a run's share of a node (scope=run) is its own line
        ceiling = 1.0 if self.scope == "run" else min(
            1.0, ray_kill_threshold() * node["ram_total_bytes"] / node["ram_limit_bytes"])
        node["ram_hard"] = hard_threshold(hard, soft, ceiling, growth, self.period_s)
        node["ram_growth_per_s"], node["ram_ceiling"] = growth, ceiling
        lv = level(node["ram_fraction"], warn, soft, node["ram_hard"])
        if self.flag is not None and (lv != "ok" or lv != self.flagged):
            self.flag.write(lv, ram_line(node, lv, node["ram_hard"], hard) if lv != "ok" else "")
            self.flagged = lv

    def _export(self, records: list[dict[str, Any]]) -> None:
        ip = {"node_ip": self.node_ip}
        for r in records:
            if r["kind"] == "node":
                self.gauges["ram"].set(r["ram_used_bytes"], tags=ip)
                self.gauges["fraction"].set(r["ram_fraction"], tags=ip)
            elif r["kind"] == "process":
                self.gauges["rss"].set(r["rss_bytes"], tags={**ip, "role": r["role"], "rank": str(r["rank"])})
            elif r["kind"] == "gpu":
                self.gauges["gpu"].set(r["used_bytes"], tags={**ip, "gpu": str(r["index"])})

    def _loop(self) -> None:
        while not self.stopped.wait(self.period_s):
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - a failed reading must not end the sampling
                logger.exception("memory sample failed on node %s", self.node_ip)

    def drain(self, sample_now: bool = True) -> list[dict[str, Any]]:
        """Everything sampled since the last drain, plus (``sample_now``) a reading taken now."""
        if sample_now:
            self.sample()
        with self.lock:
            records, self.buffer = self.buffer, []
        return records

    def peak_since(self, reset: bool = True) -> dict[str, Any]:
        """The node's highest RAM reading since the last call that reset it and a reading of its processes taken
        now, without draining what the step boundary judges: what the driver checks between two phases of a step
        (``reset``) and while one runs."""
        now = self.sample()
        with self.lock:
            peak = self.peak
            if reset:
                self.peak = {}
        return {"node": peak, "processes": [r for r in now if r["kind"] == "process"]}

    def stop(self) -> None:
        self.stopped.set()
        if self.flag is not None:
            self.flag.remove()


@dataclass
class Assessment:
    """What one step boundary concluded."""

    level: str = "ok"
    """The highest level any node's RAM or any GPU reached during the step."""
    resources: set[str] = field(default_factory=set)
    """Which memory is at that level: "ram", "vram" or both (relief differs: host offload helps only VRAM)."""
    pressure: list[str] = field(default_factory=list)
    """One line per node/GPU at or above warn: where, how full, which threshold."""
    findings: list[str] = field(default_factory=list)
    """Imbalance and leak reports."""
    metrics: dict[str, float] = field(default_factory=dict)


class Watchdog:
    """The driver's side: samplers per node, ``memory.jsonl``, thresholds, imbalance and leak detection."""

    def __init__(self, config: Config, output_dir: str) -> None:
        self.cfg = config.watchdog
        self.path = Path(output_dir) / "memory.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "a")
        self.samplers: dict[str, Any] = {}
        self.write({"kind": "thresholds", "t": time.time(), "ray_kill": ray_kill_threshold(),
                    **{f"{k}_{lv}": getattr(self.cfg, f"{k}_{lv}") for k in ("ram", "vram")
                       for lv in ("warn", "soft", "hard")}})
        self.reset()
        self.refresh_nodes()
        logger.info("memory watchdog: %d node sampler(s), every %.2f s -> %s", len(self.samplers),
                    self.cfg.sample_period_s, self.path)

    def reset(self) -> None:
        """Forget what was learnt about processes (new worker groups after a recovery, or a resume)."""
        self.leaks = LeakDetector(self.cfg.leak_warmup_steps, self.cfg.leak_mb_per_step)
        self.baseline: dict[tuple[str, int], tuple[str, int]] = {}
        self.latest: dict[tuple[str, int], tuple[str, int]] = {}
        self.reported: set[str] = set()
        self.warned_limits: set[str] = set()

    def refresh_nodes(self) -> None:
        """One sampler per alive node: start them on new nodes (a replaced node), forget lost ones."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        limit = int(self.cfg.ram_limit_gb * GB) if self.cfg.ram_limit_gb else None
        remote = ray.remote(NodeSampler)
        alive = {node["NodeID"] for node in ray.nodes() if node.get("Alive")}
        for node_id in set(self.samplers) - alive:
            logger.warning("memory watchdog: node %s is gone; its sampler with it", node_id[:12])
            self.samplers.pop(node_id)
        for node_id in sorted(alive - set(self.samplers)):
            options = {"num_cpus": 0, "max_restarts": 0, "name": f"easytrain-memory-{node_id[:12]}-{id(self):x}",
                       "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}
            thresholds = (self.cfg.ram_warn, self.cfg.ram_soft, self.cfg.ram_hard)
            self.samplers[node_id] = remote.options(**options).remote(node_id, self.cfg.sample_period_s, limit,
                                                                      self.cfg.ram_scope, thresholds)
        self.write({"kind": "samplers", "t": time.time(), "nodes": sorted(self.samplers)})

    def _ask(self, method: str, per_node: Optional[dict[str, tuple[Any, ...]]] = None,
              **kwargs: Any) -> dict[str, Any]:
        """Call every sampler (with its own arguments from ``per_node``, if given); one that died or cannot
        answer (its node lost) is dropped with a warning."""
        pending = {node: getattr(sampler, method).remote(*(per_node or {}).get(node, ()), **kwargs)
                   for node, sampler in self.samplers.items()}
        answers = {}
        for node, ref in pending.items():
            try:
                answers[node] = ray.get(ref, timeout=60)
            except ray.exceptions.RayError as err:  # dead actor, unschedulable (node lost), timeout
                logger.warning("memory watchdog: the sampler of node %s is gone (%s)", node[:12], type(err).__name__)
                self.samplers.pop(node, None)
        return answers

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")

    def register(self, processes: list[dict[str, Any]]) -> None:
        """Tell each node's sampler which processes are easytrain's: dicts with pid, role, rank, node_id.
        What was sampled before (the previous worker groups) is written but not judged."""
        self.refresh_nodes()
        self.skip_pending()
        by_node: dict[str, list[tuple[int, str, int]]] = {node: [] for node in self.samplers}
        for p in processes:
            if p["node_id"] in by_node:
                by_node[p["node_id"]].append((p["pid"], p["role"], p["rank"]))
            else:
                logger.warning("no memory sampler on node %s for %s rank %d", p["node_id"][:12], p["role"], p["rank"])
        self._ask("register", {node: (procs,) for node, procs in by_node.items()})
        self.reset()

    def skip_pending(self) -> None:
        """Write what the samplers hold without judging it (taken while relief was freeing, or before a
        recovery): the next judgement sees only what comes after."""
        for records in self._ask("drain", sample_now=False).values():
            for r in records:
                self.write(r)

    def phases(self, step: int, spans: list[tuple[str, float, float]]) -> None:
        for name, start, end in spans:
            self.write({"kind": "phase", "step": step, "name": name, "start": start, "end": end})

    def event(self, step: int, kind: str, message: str, **extra: Any) -> None:
        self.write({"kind": "event", "t": time.time(), "step": step, "level": kind, "message": message, **extra})

    def collect(self, step: int, worker_readings: Optional[list[dict[str, Any]]] = None) -> Assessment:
        """Drain every node's samples for ``step`` and judge them (call at the step boundary)."""
        lost = len(self.samplers)
        records = [r for batch in self._ask("drain").values() for r in batch]
        if len(self.samplers) < lost:
            self.refresh_nodes()  # a sampler died on a node still alive: start another
        for r in records:
            self.write(r)
        now = time.time()
        for w in worker_readings or []:
            self.write({"kind": "worker", "t": now, "step": step, **w})
        out = Assessment()
        levels, highest = [], {}
        for r in records:
            if r["kind"] == "node":
                where, used, limit, fraction = (ram_where(r), r["ram_used_bytes"],
                                                r["ram_limit_bytes"], r["ram_fraction"])
                lv, resource = self._ram_level(r), "ram"
                self._check_limit(r)
            elif r["kind"] == "process":
                self._seen(r)
                continue
            else:
                continue
            levels.append((lv, resource))
            if lv != "ok" and fraction > highest.get(where, (0.0,))[0]:
                highest[where] = (fraction, used, limit, lv)
        for g in gpu_pressure([r for r in records if r["kind"] == "gpu"], worker_readings or []):
            # judged by what its processes hold where they report it: a full cache or KV pool is no pressure
            where = f"node {g['node_ip']} GPU {g['index']}" + (" (held by its processes)" if g["basis"] == "held" else "")
            lv = level(g["fraction"], self.cfg.vram_warn, self.cfg.vram_soft, self.cfg.vram_hard)
            levels.append((lv, "vram"))
            if lv != "ok":
                highest[where] = (g["fraction"], g["held_bytes"], g["total_bytes"], lv)
            out.metrics["memory/gpu_held_fraction_max"] = max(out.metrics.get("memory/gpu_held_fraction_max", 0.0),
                                                              g["fraction"])
        out.level = worst([lv for lv, _ in levels])
        out.resources = {resource for lv, resource in levels if lv == out.level and lv != "ok"}
        out.pressure = [f"{where} at {fraction:.1%} ({used / GB:.2f} of {limit / GB:.2f} GB, {lv} threshold)"
                        for where, (fraction, used, limit, lv) in highest.items()]
        self._findings(step, records, worker_readings or [], out)
        node_fractions = [r["ram_fraction"] for r in records if r["kind"] == "node"]
        if node_fractions:
            out.metrics["memory/node_ram_fraction_max"] = max(node_fractions)
        gpu_fractions = [r["fraction"] for r in records if r["kind"] == "gpu"]
        if gpu_fractions:
            out.metrics["memory/gpu_fraction_max"] = max(gpu_fractions)
        if out.level != "ok":
            for line in out.pressure:
                self.event(step, out.level, line)
        self.file.flush()
        return out

    def _seen(self, process: dict[str, Any]) -> None:
        """A process reading: its first is the baseline its growth is measured from, the newest its size now."""
        key = (process["role"], process["rank"])
        self.baseline.setdefault(key, (process["node_ip"], process["rss_bytes"]))
        self.latest[key] = (process["node_ip"], process["rss_bytes"])

    def _hard(self, node: dict[str, Any]) -> float:
        """The hard threshold a node reading is judged by: watchdog.ram_hard, lowered by the growth its sampler saw
        (:func:`easytrain.memory.flag.hard_threshold`)."""
        if "ram_growth_per_s" not in node:
            return self.cfg.ram_hard
        return hard_threshold(self.cfg.ram_hard, self.cfg.ram_soft, node["ram_ceiling"], node["ram_growth_per_s"],
                              self.cfg.sample_period_s)

    def _ram_level(self, node: dict[str, Any]) -> str:
        return level(node["ram_fraction"], self.cfg.ram_warn, self.cfg.ram_soft, self._hard(node))

    def between_phases(self, reset: bool = True) -> tuple[str, list[str]]:
        """Each node's highest RAM reading since the last check (not drained: the step boundary still judges every
        sample) against the thresholds: the worst level and a line per node at or above warn. GPU memory is
        judged at the step boundary, where the workers' own allocator readings say what is held. ``reset=False``
        (a check while a phase runs) leaves the peak for the check at the phase's end."""
        levels, pressure = [], []
        for answer in self._ask("peak_since", reset=reset).values():
            for p in answer["processes"]:  # what grew, should the run have to stop here
                self._seen(p)
            r = answer["node"]
            if not r:
                continue
            lv = self._ram_level(r)
            levels.append(lv)
            if lv != "ok":
                pressure.append(ram_line(r, lv, self._hard(r), self.cfg.ram_hard))
        return worst(levels), pressure

    def _check_limit(self, r: dict[str, Any]) -> None:
        """With watchdog.ram_limit_gb above what Ray allows the node, the hard level could come too late."""
        if r["source"] != "config" or r["node_id"] in self.warned_limits:
            return
        kill = ray_kill_threshold() * r["ram_total_bytes"]
        if self.cfg.ram_hard * r["ram_limit_bytes"] >= kill:
            self.warned_limits.add(r["node_id"])
            logger.warning("memory watchdog: watchdog.ram_hard x watchdog.ram_limit_gb = %.1f GB on node %s is above "
                           "Ray's kill line (%.1f GB): Ray may kill a worker before the watchdog stops the run; "
                           "lower watchdog.ram_limit_gb", self.cfg.ram_hard * r["ram_limit_bytes"] / GB,
                           r["node_ip"], kill / GB)

    def _findings(self, step: int, records: list[dict[str, Any]], workers: list[dict[str, Any]],
                  out: Assessment) -> None:
        floor: dict[str, float] = {}
        for r in records:  # each series' lowest reading in the step: a leak lifts the floor, a phase's
            if r["kind"] == "node":  # transient allocations (kept or not by the allocator) do not
                name, value = f"node {r['node_ip']} ({r['node_id'][:8]}) RAM", r["ram_used_bytes"]
            elif r["kind"] == "process":
                name, value = f"{r['role']} rank {r['rank']} RSS on node {r['node_ip']}", r["rss_bytes"]
            else:
                continue
            floor[name] = min(value, floor.get(name, value))
        for w in workers:  # at the boundary a process's allocated bytes are what it keeps: a leak lifts them
            if "gpu_allocated_bytes" in w:
                floor[f"{w['role']} rank {w['rank']} GPU allocated on node {w['node_ip']}"] = w["gpu_allocated_bytes"]
        for name, value in floor.items():
            self.leaks.observe(step, name, value)
        ranks = [RankMemory(role, rank, ip, rss) for (role, rank), (ip, rss) in self.latest.items()
                 if role not in ("driver", "reward")]
        ranks += [RankMemory(w["role"], w["rank"], w["node_ip"], w["gpu_reserved_bytes"], "GPU reserved")
                  for w in workers if "gpu_reserved_bytes" in w]
        found = [("leak", key, text) for key, text in self.leaks.check()]
        found += [("imbalance", key, text) for key, text in imbalance(ranks, self.cfg.imbalance_factor)]
        for kind, key, text in found:
            if key not in self.reported:  # each finding once per worker generation
                self.reported.add(key)
                out.findings.append(text)
                self.event(step, kind, text)

    def growth(self) -> list[tuple[str, int, str, int]]:
        """(role, rank, node, bytes grown) of every process since it was registered, largest first."""
        grown = [(role, rank, ip, rss - self.baseline[(role, rank)][1])
                 for (role, rank), (ip, rss) in self.latest.items() if (role, rank) in self.baseline]
        return sorted(grown, key=lambda g: -g[3])

    def describe_growth(self, count: int = 3) -> str:
        parts = [f"{role} rank {rank} on node {ip} {grown / MB:+.0f} MB" for role, rank, ip, grown in
                 self.growth()[:count]]
        return "RSS since start: " + ", ".join(parts) if parts else "no process readings yet"

    def close(self, plot: bool = True) -> Optional[Path]:
        """Drain what the samplers hold (the last step, the final save and validation), stop them, close
        memory.jsonl and draw memory.png next to it."""
        if self.samplers:
            self.skip_pending()
            self._ask("stop")  # each removes its node's pressure flag
            for sampler in self.samplers.values():
                ray.kill(sampler)
            self.samplers = {}
        if self.file.closed:
            return None
        self.file.close()
        if not plot:
            return None
        from easytrain.memory.timeline import plot_timeline

        try:
            png = plot_timeline(self.path.parent)
        except Exception:  # noqa: BLE001 - the run's result must not depend on its plot
            logger.exception("memory timeline plot failed")
            return None
        logger.info("memory timeline: %s", png)
        return png
