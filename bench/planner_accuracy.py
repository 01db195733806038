"""The memory plan against whole runs through Ray: every phase's planned host bytes next to what the node held.

    .venv/bin/python bench/planner_accuracy.py                 # run every case, score -> bench/results/planner_accuracy.json
    .venv/bin/python bench/planner_accuracy.py --only NAME     # (re)run one case, keep the others' from the file
    .venv/bin/python bench/planner_accuracy.py --only held_out # (re)run the held-out set (--held-out-seed S)
    .venv/bin/python bench/planner_accuracy.py --rescore       # predictions only, measurements from the file

Each case is three commands on this machine, as a user runs them: a short run (``python -m easytrain.main``,
2 steps, a checkpoint after each), the same run resumed to a third step (``trainer.resume=auto``: the resume
load, one more step and checkpoint), and ``easytrain export`` of the last checkpoint. While each runs, a
sampler thread here reads every process of the command's process tree (the driver, Ray's own processes, the
workers, reward and loader processes: every process's full RSS) and the node's used memory every
:data:`SAMPLE_S` seconds.

The phases come from the run's ``memory.jsonl``: every worker call's exact host peak (``VmHWM`` reset at the
call's start, :mod:`easytrain.memory.peaks`) with its start and end (``phase_peak`` records, written by the
plan check). For one occurrence of a phase (one step's update on every rank, say) the node's measured bytes are
the workers' exact peaks in it plus, for every other process of the tree, its largest sampled RSS inside the
phase's span. The phase's figure is its largest occurrence. The export is a single process: its peak is the
high-water mark it records itself (``VmHWM`` once it has written everything, in its ``easytrain_export.json``;
not ``ru_maxrss`` from ``wait4``, which starts from this bench process's own high-water mark). Also recorded:
the largest sampled sum of the tree's RSS in the span and the node's used memory above what it was before the
command (other processes of the machine included).

``predicted`` is the plan's host bytes per node for the phase (``easytrain.memory.planner.plan``; the export
row for the export). The goal of issue 30: every phase's prediction within 10% of the measurement and never
more than 5% below it, held-out cases included. Cases are tagged ``calibration`` (the hand-written
:data:`CASES`: what the planner's constants may be fitted on) or ``held_out`` (drawn by bench/planner_shapes.py
with ``--held-out-seed``: never used to change a constant; accuracy is quoted on these).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.planner_model import BENCH_MODEL, BENCH_TEXT, BENCH_VISION, bench_model_folder  # noqa: E402
from bench.planner_shapes import BENCH_CPUS, Case, draw, placeholders  # noqa: E402
from bench.provenance import measured_provenance, write_rescored, write_result  # noqa: E402
from easytrain.trainer.export import MARKER  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "planner_accuracy.json"
RUNS = Path(os.environ.get("EASYTRAIN_BENCH_RUNS", "/tmp/easytrain-planner-accuracy"))
PY = sys.executable
SAMPLE_S = 0.02
GB = 10**9
WITHIN, LOW = 0.10, 0.05
"""The goal: |error| <= 10% and error >= -5% for every phase."""

SAMPLING = ("worker processes: exact per call, the kernel's high-water mark (VmHWM) reset through "
            "/proc/<pid>/clear_refs when the call starts, so no peak inside a call is missed; the driver, Ray's "
            f"processes, the sampler and reward workers: every {SAMPLE_S} s their VmHWM since the last sample "
            "(reset at each), so no peak is missed, only placed to within a sample; rows without "
            "'others_peaks': 'vmhwm' were measured when those were plain RSS samples, which miss a peak shorter "
            "than a period; export: the process's own VmHWM, never reset, once it has written everything (exact; rows "
            "measured before 2026-12-04 read wait4's ru_maxrss, which was the larger of this bench process's own "
            "high-water mark and the export's peak since the last sample: its tree figure is its peak)")
"""How the measured figures were taken and what the sampling can miss (written into the results file)."""
BASE = ["trainer.max_steps=2", "trainer.save_freq=1", "data.num_workers=0"]


SMALL = ["model.path=tiny:qwen2_5_vl", "model.tiny_size=small"]
RL = ["data.max_prompt_length=64"]
"""The synthetic prompts are 59 tokens: a max_prompt_length they fill, as a user would set it (the plan prices
the longest prompt the config allows). Every case's data fills its lengths (the SFT preset's 4 response tokens
hold its longest answer), so a case measures the plan's model of memory, not how far the data falls short of
the config's bound."""
MID = [f"model.path={BENCH_MODEL}", "data.max_response_length=32", "data.rollout_batch_size=4",
       "worker.actor.global_batch_size=4", "worker.rollout.n=2", "worker.actor.micro_batch_size_per_device_for_update=2",
       "worker.actor.micro_batch_size_per_device_for_experience=2"]
PX448 = ["data.min_pixels=200704", "data.max_pixels=200704"]
"""448 x 448 pixels per image (256 vision tokens after the 2 x 2 merge)."""
CASES = [
    Case("tiny_rl_fused", "calibration", RL + ["algorithm.kl_coef=0.01", "worker.actor.reuse_log_probs_on_policy=false"]),
    Case("small_rl_fused_lora", "calibration", RL + SMALL + ["model.lora.rank=8"]),
    Case("small_rl_split", "calibration", RL + SMALL + ["trainer.colocate=false", "trainer.workers_per_node=1"]),
    Case("tiny_sft", "calibration", ["+exp=tiny_sft"]),
    Case("mid_rl_fused", "calibration", RL + MID),
    Case("mid_sft", "calibration", ["+exp=tiny_sft", f"model.path={BENCH_MODEL}", "data.max_prompt_length=64"]),
    # held out until issue 47 (2026-12-02); calibration since, as earlier sessions saw their results
    Case("tiny_rl_offload", "calibration", RL + ["worker.actor.offload.params=true", "worker.ref.offload.params=true",
                                                 "algorithm.kl_coef=0.01"]),
    Case("small_sft_offload", "calibration", ["+exp=tiny_sft"] + SMALL + ["worker.actor.offload.params=true"]),
    Case("tiny_sft_lora", "calibration", ["+exp=tiny_sft", "model.lora.rank=8"]),
    Case("mid_rl_lora", "calibration", RL + MID + ["model.lora.rank=16", "algorithm.kl_coef=0.01"]),
    # added after the first held-out draw (seed 1) missed on large images and split pools: calibration only
    Case("small_rl_448", "calibration", SMALL + PX448 + ["data.max_prompt_length=320", "data.rollout_batch_size=4",
                                                         "worker.rollout.n=4", "worker.actor.global_batch_size=4",
                                                         "worker.actor.micro_batch_size_per_device_for_update=4",
                                                         "algorithm.kl_coef=0.01"]),
    Case("small_sft_448x3", "calibration", ["+exp=tiny_sft"] + SMALL + PX448 + [
        "data.max_prompt_length=832", "data.train_files={bench_images_3_train}", "data.val_files={bench_images_3_val}",
        "data.limit_images=3", "worker.actor.micro_batch_size_per_device_for_update=2"]),
    Case("tiny_rl_224x2", "calibration", ["data.min_pixels=50176", "data.max_pixels=50176", "data.max_prompt_length=192",
                                          "data.train_files={bench_images_2_train}", "data.val_files={bench_images_2_val}",
                                          "data.limit_images=2", "data.rollout_batch_size=4", "worker.rollout.n=8",
                                          "worker.actor.global_batch_size=4", "worker.actor.padding_free=true"]),
    Case("mid_rl_split", "calibration", RL + MID + ["trainer.colocate=false", "trainer.workers_per_node=1"]),
    # added after the second held-out draw (seed 2) missed on one-process actors and validation files: calibration
    Case("tiny_rl_1worker", "calibration", RL + ["trainer.workers_per_node=1", "algorithm.kl_coef=0.01"]),
    Case("small_rl_448x3", "calibration", SMALL + PX448 + [
        "data.max_prompt_length=832", "data.train_files={bench_images_3_train}", "data.val_files={bench_images_3_val}",
        "data.limit_images=3", "data.rollout_batch_size=4", "worker.rollout.n=2", "worker.actor.global_batch_size=4",
        "worker.actor.micro_batch_size_per_device_for_update=2", "worker.actor.padding_free=true"]),
    # added after the eighth held-out draw (seed 8) missed on the ~184M model with 448 px images: calibration only
    Case("mid_rl_448", "calibration", MID + PX448 + ["data.max_prompt_length=320", "worker.actor.padding_free=true"]),
    Case("mid_rl_448_unshared", "calibration", MID + PX448 + [
        "data.max_prompt_length=320", "worker.actor.padding_free=true", "worker.actor.share_prompt=false",
        "worker.actor.global_batch_size=2", "worker.actor.micro_batch_size_per_device_for_experience=4"]),
]
"""The calibration set: the cases the constants of easytrain/memory/host.py and the structure of the plan's
run phases were read from, or that earlier sessions looked at. The held-out set is drawn by
bench/planner_shapes.py with ``--held-out-seed`` (:func:`cases`)."""
HELD_OUT_SEED, HELD_OUT_RUNS = 10, 20
"""The held-out set's default seed and size. A miss on it that leads to a fix draws the next quote with a new
seed (and this default moves on)."""


def runnable(case: Case) -> bool:
    """Whether a drawn case's config validates and its worker pools fit the bench machine's BENCH_CPUS (one CPU
    per worker, ``workers_per_node`` per pool). Independent of the plan: a seed draws the same set at every
    commit."""
    from easytrain.config import compose, with_default_preset
    from easytrain.distributed.cluster import pools_per_node
    from easytrain.main import resolve

    try:
        config = resolve(compose(with_default_preset(overrides_of(case, bench_model_folder()))))
    except Exception:  # noqa: BLE001 - an invalid draw is drawn again
        return False
    return config.trainer.workers_per_node * pools_per_node(config) <= BENCH_CPUS


def cases(seed: int = HELD_OUT_SEED, runs: int = HELD_OUT_RUNS) -> list[Case]:
    """The calibration cases and the held-out set drawn with ``seed``."""
    return CASES + draw(seed, runs, "held_out", runnable)


def overrides_of(case: Case, folder: Path) -> list[str]:
    return placeholders(BASE + case.overrides, folder)


# ----------------------------------------------------------------------------- measuring


class TreeSampler:
    """Every ``SAMPLE_S``: each process of ``root``'s tree (pid -> RSS) and the node's used bytes. With
    ``reset_root`` false the root's high-water mark is left alone (an export reads its own at its end)."""

    def __init__(self, root: int, reset_root: bool = True) -> None:
        self.root, self.samples, self.reset_root = root, [], reset_root  # samples: (time, {pid: rss}, node used)
        self.kinds: dict[int, str] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        try:
            root = psutil.Process(self.root)
        except psutil.NoSuchProcess:
            return
        while not self.stop.is_set():
            rss = {}
            try:
                for proc in [root, *root.children(recursive=True)]:
                    try:
                        rss[proc.pid] = proc.memory_info().rss
                        if proc.pid not in self.kinds:  # an idle Ray worker becomes an actor: ask again
                            kind = kind_of(proc, self.root)
                            if kind != "idle":
                                self.kinds[proc.pid] = kind
                        if (self.kinds.get(proc.pid, "idle") in INTERVAL_PEAKS
                                and (self.reset_root or proc.pid != self.root)):
                            rss[proc.pid] = max(rss[proc.pid], peak_since_last_sample(proc.pid))
                    except psutil.Error:
                        continue
            except psutil.Error:
                break
            self.samples.append((time.time(), rss, psutil.virtual_memory().used))
            self.stop.wait(SAMPLE_S)

    def close(self) -> list[tuple[float, dict[int, int], int]]:
        self.stop.set()
        self.thread.join()
        return self.samples


INTERVAL_PEAKS = ("driver", "ray", "sampler", "reward", "other")
"""The kinds of process whose samples are exact peaks over the interval since the last sample (their kernel
high-water mark, reset at each sample). Never the workers' (and not a Ray worker before it names itself):
each resets its own per call for its exact phase peaks (easytrain.memory.peaks)."""


def peak_since_last_sample(pid: int) -> int:
    """The process's peak resident bytes since the last call for it (``VmHWM``, then reset by writing 5 to its
    ``clear_refs``); 0 where the kernel does not say."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                peak = int(line.split()[1]) * 1024
                Path(f"/proc/{pid}/clear_refs").write_text("5")
                return peak
    except OSError:
        pass
    return 0


def kind_of(proc: psutil.Process, root: int) -> str:
    """What a process of the run's tree is: the driver, an easytrain worker, the watchdog's node sampler, a
    reward worker, or Ray's own (GCS, raylet, dashboard and its modules, agents, monitors)."""
    if proc.pid == root:
        return "driver"
    title = " ".join(proc.cmdline())
    workers = ("ray::easytrain-", "ray::FusedWorker", "ray::ActorWorker", "ray::RolloutWorker", "ray::ReferenceWorker",
               "ray::SFTWorker")
    for prefix, kind in (*((w, "worker") for w in workers), ("ray::NodeSampler", "sampler"),
                         ("ray::RewardWorker", "reward"), ("ray::IDLE", "idle")):
        if title.startswith(prefix):
            return kind
    if "default_worker.py" in title:  # a Ray worker before it names itself: ask again
        return "idle"
    return "ray" if "ray" in title else "other"


def stop(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM (the trainer stops cleanly and Ray with it), then SIGKILL after ``grace_s``."""
    proc.terminate()
    kill = threading.Timer(grace_s, proc.kill)
    kill.daemon = True
    kill.start()


def run_sampled(argv: list[str], log: Path, timeout_s: Optional[float] = None, check: bool = True,
                reset_root: bool = True) -> dict[str, Any]:
    """Run ``argv`` with the sampler on its process tree (stopped after ``timeout_s``; ``reset_root``: see
    :class:`TreeSampler`); its exit status (``returncode``; with ``check`` a nonzero one raises), wait4's
    ``ru_maxrss`` (at least this process's own high-water mark: the kernel carries it across exec), the samples."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    node_before = psutil.virtual_memory().used
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        sampler = TreeSampler(proc.pid, reset_root)
        timer = threading.Timer(timeout_s, stop, (proc,)) if timeout_s is not None else None
        if timer is not None:
            timer.daemon = True
            timer.start()
        _, status, usage = os.wait4(proc.pid, 0)
        if timer is not None:
            timer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
        samples = sampler.close()
    if proc.returncode and check:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}); see {log}")
    return {"maxrss": usage.ru_maxrss * 1024, "samples": samples, "node_before": node_before,
            "kinds": sampler.kinds, "returncode": proc.returncode}


def phase_records(run_dir: Path) -> list[dict[str, Any]]:
    out = []
    for line in (run_dir / "memory.jsonl").read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("kind") == "phase_peak":
            out.append(record)
    return out


def measure_phases(records: list[dict[str, Any]], run: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Per phase: the node's bytes in its largest occurrence (workers' exact peaks + the others' sampled
    maxima), the largest sampled tree sum and the node's used memory above its level before the command."""
    occurrences: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for r in records:
        occurrences.setdefault((r["phase"], r["context"], r["step"]), []).append(r)
    out: dict[str, dict[str, int]] = {}
    for (phase, _, _), group in occurrences.items():
        start, end = min(r["start"] for r in group), max(r["end"] for r in group)
        inside = [s for s in run["samples"] if start <= s[0] <= end]
        if not inside:  # shorter than a sampling period: the nearest sample before it
            inside = [max((s for s in run["samples"] if s[0] <= start), key=lambda s: s[0],
                          default=run["samples"][0])]
        workers = {r["pid"]: r["host_bytes"] for r in group}
        others: dict[int, int] = {}
        for _, rss, _ in inside:
            for pid, value in rss.items():
                if pid not in workers:
                    others[pid] = max(others.get(pid, 0), value)
        by_kind: dict[str, int] = {}
        for pid, value in others.items():
            kind = run["kinds"].get(pid, "idle")
            by_kind[kind] = by_kind.get(kind, 0) + value
        figure = {"host_bytes": sum(workers.values()) + sum(others.values()),
                  "workers_bytes": sum(workers.values()), "worker_peaks": sorted(workers.values()),
                  "other_processes_bytes": sum(others.values()), "other_processes_by_kind": by_kind,
                  "processes": len(workers) + len(others),
                  "sampled_tree_peak_bytes": max(sum(rss.values()) for _, rss, _ in inside),
                  "node_used_above_before_bytes": max(u for _, _, u in inside) - run["node_before"]}
        if phase not in out or figure["host_bytes"] > out[phase]["host_bytes"]:
            out[phase] = figure
    return out


def measure_case(case: Case, folder: Path) -> dict[str, Any]:
    run_dir = RUNS / case.name
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    overrides = overrides_of(case, folder) + [f"hydra.run.dir={run_dir}"]
    start = time.perf_counter()
    phases: dict[str, dict[str, int]] = {}
    for label, extra in (("train", []), ("resume", ["trainer.max_steps=3"])):
        print(f"  {case.name}: {label} ...", flush=True)
        seen = len(phase_records(run_dir)) if (run_dir / "memory.jsonl").is_file() else 0
        run = run_sampled([PY, "-m", "easytrain.main", *overrides, *extra], RUNS / f"{case.name}.{label}.log")
        for phase, figure in measure_phases(phase_records(run_dir)[seen:], run).items():
            if phase not in phases or figure["host_bytes"] > phases[phase]["host_bytes"]:
                phases[phase] = {**figure, "command": label}
    print(f"  {case.name}: export ...", flush=True)
    run = run_sampled([PY, "-m", "easytrain.cli", "export", str(run_dir), "--out", str(run_dir / "hf_export")],
                      RUNS / f"{case.name}.export.log", reset_root=False)
    # the export's own high-water mark (VmHWM, never reset here), which it writes into its marker: wait4's ru_maxrss
    # starts from this process's high-water mark (the kernel carries it across exec), 0.54 GB in a held-out pass,
    # above an adapter export's own 0.46
    peak = json.loads((run_dir / "hf_export" / MARKER).read_text())["peak_host_bytes"]
    phases["export"] = {"host_bytes": peak, "workers_bytes": peak, "worker_peaks": [peak],
                        "ru_maxrss_bytes": run["maxrss"], "other_processes_bytes": 0, "other_processes_by_kind": {},
                        "processes": 1, "sampled_tree_peak_bytes": max(sum(r.values()) for _, r, _ in run["samples"]),
                        "node_used_above_before_bytes": max(u for _, _, u in run["samples"]) - run["node_before"],
                        "command": "export"}
    for written in ("checkpoints", "hf_export"):  # kept, one calibration and one held-out set filled 64 GB of disk
        shutil.rmtree(run_dir / written, ignore_errors=True)
    return {"name": case.name, "tag": case.tag, "overrides": BASE + case.overrides, "phases": phases,
            "malloc_mmap_threshold_kb": threshold_kb(overrides_of(case, folder)), "others_peaks": "vmhwm",
            "wall_s": time.perf_counter() - start}


# ----------------------------------------------------------------------------- scoring


def planned_rows(overrides: list[str], priced_on_data: bool = False) -> dict[str, dict[str, int]]:
    """The plan's figures per phase for a run's overrides: ``host`` (per node), ``process_host`` (the busiest
    worker process) and ``device`` (the busiest device; CPU: the working process). SFT's set-up is the
    ``load``, its ``validate`` the ``validation``, its one call per step (``sft_update``) the larger of its
    forward-backward and optimizer phases: the names its workers' readings carry. ``priced_on_data``: the plan
    on the data profile the launch check reads (bench/data_priced_plan.py), not at the limits."""
    from easytrain.config import compose, with_default_preset
    from easytrain.main import resolve
    from easytrain.memory.data_shape import DataCosts
    from easytrain.memory.planner import plan
    from easytrain.trainer.data import profile_data

    config = resolve(compose(with_default_preset(overrides)))
    p = plan(config, data=DataCosts.of(profile_data(config, progress=False)) if priced_on_data else None)
    out = {r.phase: {"host": r.host, "process_host": r.process_host, "device": r.device} for r in p.once + p.rows}
    for alias, phase in (("load", "setup"), ("validation", "validate")):
        if phase in out:
            out.setdefault(alias, out[phase])
    sft = [out[q] for q in ("forward_backward", "optimizer") if q in out]
    if sft:
        out["sft_update"] = {k: max(row[k] for row in sft) for k in ("host", "process_host", "device")}
    return out


THRESHOLD_KEY = "trainer.malloc_mmap_threshold_kb"
FIXED_BEFORE_KB = 128
"""Runs stored without their allocator setting ran when CPU workers fixed glibc's mmap threshold at 128 KiB by
default (before issue 47 made glibc's dynamic threshold the default): they are re-planned with it."""


def run_overrides(row: dict[str, Any]) -> list[str]:
    """A stored run's overrides with its allocator setting made explicit: what it ran with, whatever the
    default is now."""
    if any(o.startswith(THRESHOLD_KEY + "=") for o in row["overrides"]):
        return list(row["overrides"])
    return [*row["overrides"], f"{THRESHOLD_KEY}={row.get('malloc_mmap_threshold_kb', FIXED_BEFORE_KB)}"]


def threshold_kb(overrides: list[str]) -> int:
    """The mmap threshold (KiB, 0 = glibc's dynamic one) a run with ``overrides`` fixes in its workers."""
    from easytrain.config import compose, with_default_preset
    from easytrain.memory.host import malloc_threshold_bytes

    return malloc_threshold_bytes(compose(with_default_preset(overrides))) // 1024


def predictions(row: dict[str, Any], folder: Path) -> dict[str, dict[str, int]]:
    """The plan's figures for each phase of a stored run (its overrides, placeholders in): ``host`` per node and
    ``process_host`` for the busiest worker process (:func:`planned_rows`)."""
    return planned_rows(placeholders(run_overrides(row), folder))


def _error(predicted: Optional[int], measured: int) -> Optional[float]:
    return None if predicted is None or not measured else (predicted - measured) / measured


def score(rows: list[dict[str, Any]], folder: Path) -> None:
    """Each phase's plan beside its measurement: per node (``error``) and for the busiest worker process
    (``process_error``: the plan's ``process_host`` against the largest worker peak)."""
    for row in rows:
        predicted = predictions(row, folder)
        for phase, figure in row["phases"].items():
            plan_row = predicted.get(phase, {})
            figure["predicted_bytes"] = plan_row.get("host")
            figure["error"] = _error(figure["predicted_bytes"], figure["host_bytes"])
            figure["predicted_process_bytes"] = plan_row.get("process_host")
            figure["process_error"] = _error(figure["predicted_process_bytes"], max(figure.get("worker_peaks") or [0]))


def _accuracy(rows: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """Worst errors, phases in the band and misses of each split, for the error under ``key``."""
    ok = lambda e: -LOW <= e <= WITHIN  # noqa: E731
    accuracy = {}
    for tag in ("calibration", "held_out"):
        values = [(f"{r['name']}:{p}", f[key]) for r in rows if r["tag"] == tag for p, f in r["phases"].items()
                  if f.get(key) is not None]
        if values:
            errors = [e for _, e in values]
            accuracy[tag] = {"worst_under_prediction": min(errors), "worst_over_prediction": max(errors),
                             "within_goal": f"{sum(map(ok, errors))} of {len(errors)}",
                             "runs": len({r["name"] for r in rows if r["tag"] == tag}),
                             "misses": {name: round(e, 4) for name, e in values if not ok(e)}}
    return accuracy


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The goal over every phase, and the accuracy of each split apart: ``calibration`` (the rows the planner's
    constants were read from) and ``held_out`` (rows that only check them); per node (``accuracy``, the goal)
    and for the busiest worker process (``accuracy_per_process``: what the in-run plan check compares)."""
    errors = [f["error"] for r in rows for f in r["phases"].values() if f["error"] is not None]
    unpredicted = sorted({f"{r['name']}:{p}" for r in rows for p, f in r["phases"].items() if f["error"] is None})
    met = bool(errors) and not unpredicted and all(-LOW <= e <= WITHIN for e in errors)
    return {"accuracy": _accuracy(rows, "error"), "accuracy_per_process": _accuracy(rows, "process_error"),
            "goal": {"text": f"every phase within {WITHIN:.0%} of measured and never more than {LOW:.0%} low",
                     "met": met, "unpredicted": unpredicted},
            "gpu": "none measured: no GPU machine was lent to the session that ran this"}


def table(rows: list[dict[str, Any]]) -> str:
    head = f"{'case':22} {'tag':11} {'phase':15} {'measured':>9} {'predicted':>9} {'error':>7} {'tree':>7} {'node':>7}"
    lines = ["GB (1e9 bytes) per node; measured = workers' exact phase peaks + other processes' sampled RSS; "
             "tree = sampled sum; node = used above before", head, "-" * len(head)]
    for r in rows:
        for phase, f in r["phases"].items():
            pred = f"{f['predicted_bytes'] / GB:9.3f}" if f["predicted_bytes"] is not None else "        -"
            err = f"{100 * f['error']:+6.1f}%" if f["error"] is not None else "      -"
            lines.append(f"{r['name']:22} {r['tag']:11} {phase:15} {f['host_bytes'] / GB:9.3f} {pred} {err} "
                         f"{f['sampled_tree_peak_bytes'] / GB:7.3f} {f['node_used_above_before_bytes'] / GB:7.3f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", default=[],
                        help="case name or tag (calibration, held_out; repeatable); the others kept from the file")
    parser.add_argument("--rescore", action="store_true", help="re-predict only; measurements from the results file")
    parser.add_argument("--held-out-seed", type=int, default=HELD_OUT_SEED, help="the held-out set's seed")
    parser.add_argument("--held-out-runs", type=int, default=HELD_OUT_RUNS, help="the held-out set's size")
    args = parser.parse_args()
    start = time.perf_counter()
    every = cases(args.held_out_seed, args.held_out_runs)
    unknown = set(args.only) - {c.name for c in every} - {c.tag for c in every}
    if unknown:
        parser.error(f"unknown case(s) {sorted(unknown)}; cases: {', '.join(c.name for c in every)}")
    folder = bench_model_folder()
    old = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    kept = {r["name"]: r for r in old.get("rows", []) if "phases" in r}
    if args.rescore and not kept:
        parser.error(f"--rescore needs measurements in {RESULTS}")
    stored_seed = old.get("held_out_set", {}).get("seed")
    if args.rescore and stored_seed not in (None, args.held_out_seed):  # else its held-out rows would be dropped
        parser.error(f"{RESULTS} holds held-out seed {stored_seed}'s runs: rescore them with "
                     f"--held-out-seed {stored_seed}, or measure seed {args.held_out_seed}'s first")
    RUNS.mkdir(parents=True, exist_ok=True)
    for case in every:
        if args.rescore or (args.only and not {case.name, case.tag} & set(args.only)):
            continue
        print(f"measuring {case.name} ...", flush=True)
        try:
            kept[case.name] = measure_case(case, folder)
        except RuntimeError as error:  # one failed command: the other cases still count
            print(f"{case.name}: {error}", flush=True)
    rows = []
    for case in every:
        row = kept.get(case.name)
        if row is None or row["overrides"] != BASE + case.overrides:
            print(f"{case.name}: no measurement for these overrides; run it (--only {case.name})")
            continue
        rows.append({**row, "tag": case.tag})
    score(rows, folder)
    print(table(rows))
    reused = ({k: old.get(k) for k in ("commit", "date")} if args.only else
              old.get("measurements_reused_from") if args.rescore else None)  # a rescore keeps the stored origin
    result = {"measurements_reused_from": reused,
              "bench_model": {"folder": str(folder), "placeholder": BENCH_MODEL, "text": BENCH_TEXT,
                              "vision": BENCH_VISION, "tie_word_embeddings": False},
              "sample_period_s": SAMPLE_S, "sampling": SAMPLING,
              "held_out_set": {"generator": "bench/planner_shapes.py", "seed": args.held_out_seed,
                               "runs": args.held_out_runs},
              **summary(rows), "rows": rows,
              "wall_s": time.perf_counter() - start if not args.rescore else old.get("wall_s")}
    if args.rescore:  # the measurements are the stored run's: so is the provenance (bench/provenance.py)
        write_rescored(RESULTS, result, measured_provenance(old), indent=1)
    else:
        write_result(RESULTS, result, indent=1)
    for scope, key in (("per node", "accuracy"), ("per process", "accuracy_per_process")):
        for tag, s in result[key].items():
            print(f"{tag} ({scope}): {s['within_goal']} phases within the goal, worst under "
                  f"{s['worst_under_prediction']:+.1%}, over {s['worst_over_prediction']:+.1%}")
    print(f"goal ({result['goal']['text']}): {'met' if result['goal']['met'] else 'not met'}; "
          f"wall {time.perf_counter() - start:.0f} s -> {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
