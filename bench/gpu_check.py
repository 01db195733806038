"""One call on a GPU: everything a GPU can show, measured in one command (issue 46).

    # here, once:  bash ../shared/gpu/bundle.sh --with-trl
    # on the GPU machine, in the carried checkout (carry .gpu), within the device's 10-minute call limit:
    source .gpu/setup.sh; EASYTRAIN_COMMIT=<sha> EASYTRAIN_DIRTY=0 python bench/gpu_check.py

Without CUDA it exits 2 with one line and writes nothing; so it does where the result could not name a commit
(a copy without git needs ``EASYTRAIN_COMMIT`` and ``EASYTRAIN_DIRTY``). On a GPU it writes
``bench/results/gpu_check.json``
after every part (and a copy into ``$OUT`` when the device tool set it), so a run cut short keeps what it
measured; a part that fails is recorded as failed, a part the time budget (``--budget-s``, default 450 s)
did not reach as not run; every subprocess it starts is stopped when the budget is spent (decode and
first_token run in a child of this script for that reason). The parts, in order:

1. ``machine``: GPU name and memory, driver, CUDA, torch, transformers, and whether flash-attn, vLLM and TRL
   import (each tried in a fresh process);
2. ``step``: easytrain against TRL's GRPOTrainer on the same ``random:qwen25vl_3b`` folder, both shapes of
   ``bench/gpu_step.py`` (small images 8x4, 448 px images 4x8; 32 tokens, beta 0.04, bf16, gradient
   checkpointing): median s/step and each phase, generated tokens/s, the update's MFU, the weight sync against
   one device-to-device copy of the bf16 weights. easytrain runs as a user runs it (``python -m
   easytrain.main``, one fused worker); the small shape saves a checkpoint after its last step and is resumed
   for one more step, so the load, the save and the resume are measured too;
3. ``memory``: from those same easytrain runs, per phase, planned against measured: device (torch's allocator
   peak per process, ``phase_peak`` records of ``memory.jsonl``; NVML's used bytes per GPU, sampled here every
   :data:`SAMPLE_S` inside the phase's span) and host (the busiest worker's RSS peak; the node: the workers'
   exact peaks plus every other process's sampled RSS, as ``bench/planner_accuracy.py`` measures; also the
   node's used RAM above its level before the run). These shapes are held out: no planner constant is fitted
   on them (:data:`SPLIT`);
4. ``tests``: ``pytest tests/gpu -m gpu``, every test with its outcome (a failure is recorded as a failure);
5. ``decode``: ``bench/decode_rate.py``'s static-cache decode against ``generate`` on the small shape's prompts;
6. ``first_token``: ``bench/first_token.py``'s probe of the tiny model's engine against actor log-prob gap
   (float32), per decode path, attention kernel and actor layout: the H200's 0.6-nat first-token gap, found or not.

``--rescore`` plans the stored runs again with this checkout (no GPU needed) and keeps the measuring machine's
provenance (``rescored`` says where and at which commit it was scored: bench/provenance.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.provenance import measured_provenance, write_rescored, write_result  # noqa: E402

log = logging.getLogger("gpu_check")
RESULTS = ROOT / "bench" / "results" / "gpu_check.json"
PY = sys.executable
PARTS = ("machine", "step", "memory", "tests", "decode", "first_token")
SPLIT = "held_out"
"""No planner constant may be fitted on this file's runs: its accuracy is held-out accuracy."""
WITHIN, LOW = 0.10, 0.05
"""The memory goal: every phase within 10% of the measurement and never more than 5% below it."""
SAMPLE_S = 0.02
"""NVML sampling period while an easytrain run runs."""
MEASURES = ("device_torch", "device_nvml", "process_host", "node_host")
"""What the memory part compares, per phase: the plan's figure for it is named in :func:`score_phases`."""
IMPORTS = ("flash_attn", "vllm", "trl")
RESERVE_S = 150
"""Seconds an easytrain run leaves of the budget for what follows it (TRL's side, the resume, the parts after)."""
SAVED_SHAPE = "small"
"""The shape whose run saves a checkpoint and is resumed (the 3B model's fp32 weights and Adam states are
~41 GB on disk: one shape's, deleted after its resume)."""


class Budget:
    """The seconds left of the whole check; each subprocess gets at most what is left."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


class Report:
    """The result file, written after every part so that a run cut short keeps what it measured."""

    def __init__(self, path: Path, settings: dict[str, Any], out_dir: Optional[Path] = None) -> None:
        self.path, self.out_dir = path, out_dir
        self.record: dict[str, Any] = {"benchmark": "gpu_check", "settings": settings, "parts": {},
                                       "parts_not_run": list(PARTS)}

    def run(self, name: str, part: Callable[[], dict[str, Any]], budget: Budget, needs_s: float) -> dict[str, Any]:
        """Run one part and write the file; a part that raises is recorded as failed, one the budget cannot fit
        (``needs_s`` seconds at least) as not run."""
        if budget.left() < needs_s:
            result: dict[str, Any] = {"not_run": f"the time budget had {max(0, budget.left()):.0f} s left, the "
                                                 f"part needs about {needs_s:.0f} s"}
        else:
            start = time.monotonic()
            try:
                result = part()
            except Exception as error:  # noqa: BLE001 - one part's failure is a finding; the others still run
                log.exception("part %s failed", name)
                result = {"failed": f"{type(error).__name__}: {error}"}
            result["wall_s"] = round(time.monotonic() - start, 1)
        self.record["parts"][name] = result
        self.record["parts_not_run"] = [p for p in PARTS if p not in self.record["parts"]
                                        or "not_run" in self.record["parts"][p]]
        self.write()
        return result

    def write(self) -> None:
        write_result(self.path, self.record)
        if self.out_dir is not None:  # the device tool brings $OUT back, even from a call cut short
            self.out_dir.mkdir(parents=True, exist_ok=True)
            (self.out_dir / self.path.name).write_bytes(self.path.read_bytes())


# ----------------------------------------------------------------------------- part 1: the machine


def machine_part() -> dict[str, Any]:
    import torch
    import transformers

    from bench.gpu_smoke import device

    found: dict[str, Any] = {"device": device(), "torch": torch.__version__, "transformers": transformers.__version__,
                             "device_count": torch.cuda.device_count(), "imports": {}}
    for module in IMPORTS:  # each in a fresh process: a broken install cannot take this one down
        try:
            done = subprocess.run([PY, "-c", f"import {module}; print(getattr({module}, '__version__', '?'))"],
                                  capture_output=True, text=True, timeout=60, cwd=ROOT)
        except subprocess.TimeoutExpired:
            found["imports"][module] = {"error": "import took over 60 s"}
            continue
        found["imports"][module] = (done.stdout.strip() if done.returncode == 0 else
                                    {"error": (done.stderr.strip().splitlines() or ["?"])[-1][:300]})
    return found


# ----------------------------------------------------------------------------- part 2: the step, easytrain and TRL


def nvml_in(samples: list[dict[str, Any]], start: float, end: float) -> Optional[list[int]]:
    """Each GPU's largest used bytes sampled inside [start, end] (bench/gpu_readings.py's ``NvmlSampler``
    samples; the last sample before it when none falls inside: a phase shorter than the period); None without
    samples."""
    inside = [s["used_per_gpu"] for s in samples if start <= s["t"] <= end]
    if not inside:
        before = [s["used_per_gpu"] for s in samples if s["t"] <= start]
        inside = before[-1:] or [s["used_per_gpu"] for s in samples[:1]]
    return [max(column) for column in zip(*inside)] if inside else None


def easytrain_run(overrides: list[str], run_dir: Path, log_path: Path,
                  timeout_s: Optional[float] = None) -> dict[str, Any]:
    """``python -m easytrain.main`` with the process-tree sampler (bench/planner_accuracy.py) and NVML sampled
    here, stopped after ``timeout_s``; the phases it measured (from ``memory.jsonl``) and its metrics lines, kept
    when the run fails too (with ``failed`` and its log's tail)."""
    from bench.gpu_readings import NvmlSampler
    from bench.planner_accuracy import phase_records, run_sampled
    from easytrain.memory.readings import gpu_readings, open_nvml

    seen = len(phase_records(run_dir)) if (run_dir / "memory.jsonl").is_file() else 0
    seen_metrics = len(metric_rows(run_dir))
    start = time.monotonic()
    handle = open_nvml()
    before = [g["used_bytes"] for g in gpu_readings(handle)] if handle is not None else []
    with NvmlSampler(handle, SAMPLE_S) as nvml:
        run = run_sampled([PY, "-m", "easytrain.main", *overrides, f"hydra.run.dir={run_dir}"], log_path, timeout_s,
                          check=False)
    records = phase_records(run_dir)[seen:] if (run_dir / "memory.jsonl").is_file() else []
    out: dict[str, Any] = {"wall_s": round(time.monotonic() - start, 1),
                           "phases": measured_phases(records, run, nvml.samples, before),
                           "metrics": metric_rows(run_dir)[seen_metrics:]}
    if run["returncode"]:
        out["failed"] = f"exit {run['returncode']}"
        out["log_tail"] = log_path.read_text()[-3000:] if log_path.is_file() else ""
    return out


def measured_phases(records: list[dict[str, Any]], run: dict[str, Any], nvml: list[dict[str, Any]],
                    before: Optional[list[int]] = None) -> dict[str, dict[str, Any]]:
    """Per phase, its largest occurrence of each measure: the node's host bytes (bench/planner_accuracy.py's
    figure), the busiest worker process's RSS peak, the busiest process's torch peak, and the busiest GPU's
    NVML used bytes inside the phase's span above what it held ``before`` the run (this process's own CUDA
    context is not the run's)."""
    from bench.planner_accuracy import measure_phases

    out = {phase: {"node_host": f["host_bytes"], "node_used_above_before": f["node_used_above_before_bytes"],
                   "sampled_tree_peak": f["sampled_tree_peak_bytes"], "processes": f["processes"]}
           for phase, f in (measure_phases(records, run).items() if run["samples"] else ())}
    for r in records:
        row = out.setdefault(r["phase"], {})
        row["process_host"] = max(row.get("process_host", 0), int(r["host_bytes"]))
        row["device_torch"] = max(row.get("device_torch", 0), int(r.get("device_bytes", 0)))
        used = nvml_in(nvml, r["start"], r["end"])
        if used is not None:
            above = [u - b for u, b in zip(used, before or [0] * len(used))]
            row["device_nvml"] = max(row.get("device_nvml", 0), max(above))
    return out


def metric_rows(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def step_summary(metrics: list[dict[str, Any]], warmup: int, params: int, peak: Optional[float]) -> dict[str, Any]:
    """Medians over the steps after ``warmup``: s/step, each phase, generated tokens/s, the sync and the update's
    MFU (6 x parameters x update tokens / update seconds / the card's bf16 peak)."""
    from easytrain.trainer.mfu import update_mfu

    steps = [m for m in metrics if "time/step" in m][warmup:]
    if not steps:
        raise RuntimeError(f"the run logged {len(metrics)} metrics lines and no step after the {warmup} warm-up")
    median = statistics.median
    phases = sorted({k[5:] for m in steps for k in m if k.startswith("time/") and k != "time/step"})
    update_s, tokens = median(m.get("time/update", 0.0) for m in steps), median(m.get("perf/update_tokens", 0)
                                                                                 for m in steps)
    return {"steps_measured": len(steps), "median_step_s": median(m["time/step"] for m in steps),
            "median_phase_s": {p: median(m.get(f"time/{p}", 0.0) for m in steps) for p in phases},
            "median_generated_tokens_per_s": median(m.get("perf/generate_tokens_per_s", 0.0) for m in steps),
            "median_sync_s": median(m.get("sync/seconds", 0.0) for m in steps), "median_update_tokens": tokens,
            "update_mfu": update_mfu(params, int(tokens), update_s, peak) if peak and update_s else None}


STEPS_KEYS = ("trainer.max_steps=", "trainer.save_freq=")


def run_overrides(folder: Path, shape: str, steps: int, device: str, save: bool) -> list[str]:
    """bench/gpu_step.py's settings for ``shape``, with a checkpoint after the last step when ``save``."""
    from bench.gpu_step import easytrain_overrides

    base = [o for o in easytrain_overrides(folder, shape, "hf", "", steps, device)
            if not o.startswith(("trainer.output_dir=", *STEPS_KEYS))]
    return [*base, f"trainer.max_steps={steps}", f"trainer.save_freq={steps if save else 0}"]


def resume_overrides(overrides: list[str], steps: int) -> list[str]:
    """The same run resumed from its checkpoint (``trainer.resume=auto``) for one more step, saving nothing."""
    return [*(o for o in overrides if not o.startswith(STEPS_KEYS)), f"trainer.max_steps={steps + 1}",
            "trainer.save_freq=0"]


def step_part(folder: Path, args: argparse.Namespace, budget: Budget, runs: dict[str, Any],
              report: Report) -> dict[str, Any]:
    """Both shapes, easytrain then TRL, then the resume of the saved shape; ``runs`` receives each easytrain
    run's overrides and measured phases for the memory part. What is measured is written after every run (a
    call cut short keeps it); the checkpoint (tens of GB) is deleted whatever happens."""
    import torch

    from bench.gpu_step import GOALS, SYNC_GOAL, device_copy_s, parameters
    from easytrain.trainer.mfu import peak_bf16_flops

    params = parameters(folder)
    peak = peak_bf16_flops(torch.cuda.get_device_name(0))
    steps = args.warmup + args.steps
    work = Path(tempfile.mkdtemp(prefix="easytrain-gpu-check-"))
    out: dict[str, Any] = {"model": {"name": "random:qwen25vl_3b", "parameters": params, "bf16_bytes": params * 2},
                           "peak_bf16_flops": peak, "shapes": {}}

    def keep(name: str, run: dict[str, Any], overrides: list[str]) -> None:
        runs[name] = {"overrides": overrides, "phases": run["phases"], "wall_s": run["wall_s"],
                      **({"failed": run["failed"]} if "failed" in run else {})}

    try:
        for shape in args.shapes:
            overrides = run_overrides(folder, shape, steps, "cuda", save=shape == SAVED_SHAPE)
            out["shapes"][shape] = shape_step(folder, shape, overrides, work, args, budget, params, peak, keep)
            report.record["parts"]["step"] = {**out, "partial": True}
            report.write()
        if SAVED_SHAPE in runs and budget.left() > 60:  # the resume: load the checkpoint, one more step
            overrides = resume_overrides(runs[SAVED_SHAPE]["overrides"], steps)
            run = easytrain_run(overrides, work / SAVED_SHAPE, work / f"{SAVED_SHAPE}.resume.log", budget.left())
            keep(f"{SAVED_SHAPE}_resume", run, overrides)
            if "failed" in run:
                out["resume"] = {"failed": run["failed"], "log_tail": run["log_tail"]}
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the checkpoint: tens of GB on the machine's disk
    syncs = [s["easytrain"]["median_sync_s"] for s in out["shapes"].values()
             if s.get("easytrain", {}).get("median_sync_s")]
    sync_s = min(syncs, default=None)
    try:
        copy_s: Optional[float] = device_copy_s(params * 2)
    except RuntimeError as error:  # two model-sized buffers: out of memory is a finding, not the part's end
        copy_s, out["device_copy_error"] = None, str(error)[:300]
    ratio = sync_s / copy_s if sync_s and copy_s else None
    out["sync"] = {"device_copy_s": copy_s, "sync_s": sync_s, "ratio": ratio, "goal": SYNC_GOAL,
                   "goal_met": None if ratio is None else ratio <= SYNC_GOAL}
    for shape, figures in out["shapes"].items():
        figures.setdefault("goal", GOALS[shape])
    return out


def shape_step(folder: Path, shape: str, overrides: list[str], work: Path, args: argparse.Namespace, budget: Budget,
               params: int, peak: Optional[float],
               keep: Callable[[str, dict[str, Any], list[str]], None]) -> dict[str, Any]:
    """One shape: easytrain's run (at most what the budget has left, less a reserve for the parts after it),
    then TRL's where time is left; their medians and ratio."""
    from bench.gpu_step import GOALS, side

    if budget.left() < 90:
        return {"not_run": f"the time budget had {max(0, budget.left()):.0f} s left"}
    run = easytrain_run(overrides, work / shape, work / f"{shape}.log", max(60, budget.left() - RESERVE_S))
    keep(shape, run, overrides)
    try:
        mine: dict[str, Any] = {**step_summary(run["metrics"], args.warmup, params, peak), "wall_s": run["wall_s"]}
    except RuntimeError as error:  # no step after the warm-up: nothing to time
        mine = {"failed": run.get("failed", str(error)), "log_tail": run.get("log_tail", "")}
    if "failed" in run:
        mine.update(failed=run["failed"], log_tail=run["log_tail"])
    if budget.left() < 60:
        theirs: dict[str, Any] = {"not_run": f"the time budget had {max(0, budget.left()):.0f} s left"}
    else:
        theirs = side("trl", folder, shape, args.steps, args.warmup, int(budget.left()))
    ratio = (theirs["median_step_s"] / mine["median_step_s"] if "median_step_s" in theirs
             and "median_step_s" in mine else None)
    log.info("%s: easytrain %s s/step, TRL %s s/step, ratio %s", shape, mine.get("median_step_s"),
             theirs.get("median_step_s"), ratio)
    return {"easytrain": mine, "trl": theirs, "step_rate_vs_trl": ratio, "goal": GOALS[shape],
            "goal_met": None if ratio is None else ratio >= GOALS[shape]}


# ----------------------------------------------------------------------------- part 3: planned against measured


def planned_for(overrides: list[str], gpu_bytes: Optional[int]) -> dict[str, dict[str, int]]:
    """The plan's figures per phase for a run's overrides: node host, busiest worker process's host, and the
    busiest device's bytes (with the CUDA context: NVML's view) and less it (torch's allocator's view)."""
    from bench.planner_accuracy import planned_rows
    from easytrain.memory.capacity import CUDA_CONTEXT_BYTES

    extra = [f"trainer.gpu_memory_gb={gpu_bytes / 1e9}"] if gpu_bytes else []
    rows = planned_rows([*overrides, *extra])
    return {phase: {"node_host": r["host"], "process_host": r["process_host"], "device_nvml": r["device"],
                    "device_torch": r["device"] - CUDA_CONTEXT_BYTES} for phase, r in rows.items()}


def score_phases(measured: dict[str, dict[str, Any]], planned: dict[str, dict[str, int]]) -> dict[str, Any]:
    """Each phase's measures next to the plan: ``error`` = planned / measured - 1 (negative: the plan is low)."""
    out: dict[str, Any] = {}
    for phase, figures in measured.items():
        plan = planned.get(phase)
        row: dict[str, Any] = {}
        for what in MEASURES:
            if what not in figures or not figures[what]:
                continue
            p = None if plan is None else plan.get(what)
            row[what] = {"measured_bytes": figures[what], "planned_bytes": p,
                         "error": None if p is None else round(p / figures[what] - 1, 4)}
        row["node_used_above_before_bytes"] = figures.get("node_used_above_before")
        out[phase] = row
    return out


def accuracy(runs: dict[str, Any]) -> dict[str, Any]:
    """Per measure over every run's phases: the worst under- and over-prediction, how many phases meet the goal,
    and which phases miss it (run:phase and the error)."""
    out: dict[str, Any] = {}
    for what in MEASURES:
        errors = [(f"{name}:{phase}", row[what]["error"]) for name, run in runs.items()
                  for phase, row in run.get("scored", {}).items() if row.get(what, {}).get("error") is not None]
        if not errors:
            continue
        values = [e for _, e in errors]
        misses = {where: e for where, e in errors if not -LOW <= e <= WITHIN}
        out[what] = {"worst_under_prediction": min(0.0, min(values)), "worst_over_prediction": max(0.0, max(values)),
                     "within_goal": f"{len(errors) - len(misses)} of {len(errors)}", "misses": misses}
    return out


def memory_part(runs: dict[str, Any], gpu_bytes: Optional[int]) -> dict[str, Any]:
    """Every easytrain run's phases scored against this checkout's plan (its held-out accuracy)."""
    for run in runs.values():
        run["scored"] = score_phases(run["phases"], planned_for(run["overrides"], gpu_bytes))
    return {"split": SPLIT, "goal": f"every phase within {WITHIN:.0%} of measured and never more than {LOW:.0%} low, "
            "host and device", "runs": runs, "accuracy": {SPLIT: accuracy(runs)}}


# ----------------------------------------------------------------------------- parts 4 and 5


def tests_part(budget: Budget) -> dict[str, Any]:
    from bench.gpu_smoke import run_tests

    return run_tests(int(max(60, budget.left())))


def in_child(part: str, folder: Optional[Path], budget: Budget) -> dict[str, Any]:
    """A part run by this script in a fresh process (``--part``), stopped when the budget is spent: its CUDA state,
    compilations and a hang stay out of this process."""
    from bench.gpu_step import json_child

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "part.json"
        command = [PY, str(Path(__file__)), "--part", part, "--out", str(out)]
        command += ["--model", str(folder)] if folder is not None else []
        limit = max(1.0, budget.left())
        return json_child(command, out, limit, f"stopped after {limit:.0f} s: the time budget was spent")


def run_child_part(part: str, folder: Optional[Path], out: Path) -> None:
    """``--part decode`` (bench/decode_rate.py on the small shape's prompts) or ``--part first_token``
    (bench/first_token.py's probe), its result written to ``out``."""
    import torch

    if part == "decode":
        from bench.gpu_step import decode_part

        result = decode_part(folder)
    else:
        from bench.first_token import measure

        result = measure(torch.device("cuda"))
    out.write_text(json.dumps(result, default=str))


def checked_commit() -> Optional[str]:
    """Why the result's provenance could not name a commit of this repository (None when it can): on a copy of
    the checkout without git, EASYTRAIN_COMMIT must be a full commit id and EASYTRAIN_DIRTY 0 or 1."""
    import re

    from bench.provenance import git_state

    state = git_state()
    if not isinstance(state["commit"], str) or not re.fullmatch(r"[0-9a-f]{40}", state["commit"]):
        return "set EASYTRAIN_COMMIT to the full commit id the copy was made at (git has none here)"
    if state["dirty"] is None:
        return "set EASYTRAIN_DIRTY=0 (or 1 if the copy has uncommitted changes)"
    return None


# ----------------------------------------------------------------------------- the command


def rescore(path: Path = RESULTS) -> dict[str, Any]:
    """The stored runs' measurements against this checkout's plan; the measuring machine's provenance kept."""
    stored = json.loads(path.read_text())
    record = {k: v for k, v in stored.items() if k in ("benchmark", "settings", "parts", "parts_not_run")}
    memory = record.get("parts", {}).get("memory", {})
    if "runs" not in memory:
        raise SystemExit(f"{path}: no memory part to rescore")
    gpu_bytes = record["parts"].get("machine", {}).get("device", {}).get("total_bytes")
    record["parts"]["memory"] = {**memory_part(memory["runs"], gpu_bytes), "wall_s": memory.get("wall_s")}
    write_rescored(path, record, measured_provenance(stored))
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=["small", "image_heavy"], default=["small", "image_heavy"])
    parser.add_argument("--steps", type=int, default=2, help="measured steps per side and shape")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--budget-s", type=float, default=450.0, help="the whole check's time budget")
    parser.add_argument("--rescore", action="store_true", help="plan the stored runs again (no GPU needed)")
    parser.add_argument("--part", choices=["decode", "first_token"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.rescore:
        rescore()
        return
    if args.part is not None:  # a child of this script: one part
        run_child_part(args.part, args.model, args.out)
        return
    import torch

    if not torch.cuda.is_available():
        print("bench/gpu_check.py needs CUDA and this machine has none: nothing written (run it on a GPU machine: "
              "docs/cluster.md)", file=sys.stderr)
        sys.exit(2)
    why = checked_commit()
    if why is not None:
        print(f"bench/gpu_check.py: {why}; nothing measured", file=sys.stderr)
        sys.exit(2)
    from bench.gpu_step import model_folder

    budget = Budget(args.budget_s)
    report = Report(RESULTS, {"shapes": args.shapes, "steps": args.steps, "warmup": args.warmup,
                              "budget_s": args.budget_s}, Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    machine = report.run("machine", machine_part, budget, 0)
    try:
        folder: Optional[Path] = model_folder()
    except Exception as error:  # noqa: BLE001 - the parts that need no model still run
        log.exception("the random:qwen25vl_3b folder could not be built")
        folder, report.record["model_folder_error"] = None, f"{type(error).__name__}: {error}"[:500]
    runs: dict[str, Any] = {}
    without = lambda: {"failed": "no model folder (model_folder_error)"}  # noqa: E731
    report.run("step", (lambda: step_part(folder, args, budget, runs, report)) if folder else without, budget, 120)
    gpu_bytes = machine.get("device", {}).get("total_bytes")
    report.run("memory", lambda: memory_part(runs, gpu_bytes) if runs else {"failed": "no easytrain run"}, budget, 0)
    report.run("tests", lambda: tests_part(budget), budget, 120)
    report.run("decode", (lambda: in_child("decode", folder, budget)) if folder else without, budget, 90)
    report.run("first_token", lambda: in_child("first_token", None, budget), budget, 90)
    print(json.dumps({p: sorted(v) for p, v in report.record["parts"].items()}), flush=True)


if __name__ == "__main__":
    main()
