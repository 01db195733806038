"""easytrain against Hugging Face TRL's GRPOTrainer: the same GRPO step, run alternately, side by side.

    # what produced bench/results/trl_compare.json (~25 min):
    .venv/bin/python bench/trl_compare.py --sizes tiny small --repeats 3 --fresh
    # the text-only Qwen2 of the same sizes on both sides (data.image_key=null), if TRL's VL path fails:
    .venv/bin/python bench/trl_compare.py --family qwen2 --sizes tiny small

What runs, for each model size, ``--repeats`` times, in rotating order:

- ``easytrain``: ``bench/grpo_step.py`` (the real trainer: local Ray,
  actor, reference and rollout in one fused worker process per device,
  HF engine) with one device, whose process by
  ``trainer.threads_per_worker``'s default uses both cores, and all 32
  sequences of a step in one micro batch (TRL's
  ``per_device_train_batch_size=32``); run as a subprocess of this venv's
  python;
- ``easytrain_2w``: two fused worker processes (FSDP2 over gloo), one
  core each, 16 sequences per micro batch;
- ``easytrain_plain``: ``easytrain`` with the step optimisations off
  (``share_prompt``, ``dedupe_images``; the recorded result also turned
  off the HF engine's shared prefill and decode loop, switches then, one path since): what they are worth
  here;
- ``trl``: ``bench/_trl_side.py`` (TRL's ``GRPOTrainer``, one process), run
  with the bench venv's python.

Both sides use the same tiny model folder (``easytrain.models.tiny.build_tiny``,
seed 0; built here and handed to TRL by path, its sha256 recorded), the same
synthetic rows (the colour question, 128 train rows, seed 1, difficulty 0),
the same reward (easytrain's ``answer``), 8 prompts x 4 samples per optimizer
step, 32 new tokens, temperature 1, a reference model with KL coefficient 0.04
in the loss (k3 estimator on both sides), token-mean loss, clip 0.2/0.28, AdamW
lr 1e-3, fp32, CPU. Each run discards ``--warmup`` steps and measures
``--steps``; a variant's figure is the median over its runs of each run's
median. Seconds per step is the wall time of a whole step (easytrain: the
trainer's ``time/step``, data to weight sync; TRL: between consecutive
``on_step_end`` callbacks). Generated tokens per second is the step's
generated tokens over that step time (end to end); the generation phase alone
is reported too. The ratio is easytrain's step rate over TRL's (TRL's
seconds per step / easytrain's): >1 means easytrain is faster.

Thread counts: TRL's process reports ``torch.get_num_threads()``; for
easytrain, whose workers are Ray actors, this script samples each worker
process's per-thread CPU time while it runs and counts the threads that
compute (see ``ThreadWatch``), next to the ``OMP_NUM_THREADS`` it inherited.

Before each run it waits (up to ``--max-wait`` s) until no ``ray::`` process
and no pytest runs on the machine, since concurrent load ruins timings, and
while the run goes on it polls for such processes that are not the run's own;
a run that saw any is ``disturbed``: it is listed under ``discarded_runs`` and
run again (``--retries``), and kept (flagged, left out of the medians unless
all runs were) only when the retries are used up.

The bench environment (TRL must never be an easytrain dependency nor enter
``.venv``), made once:

    python3 -m venv /work/bench-venv
    /work/bench-venv/bin/pip install torch==2.13.0      # the CPU build; pin it, a plain `torch` pulls CUDA
    /work/bench-venv/bin/pip install -e /work/main      # easytrain and its pins (transformers 5.19.0 here)
    /work/bench-venv/bin/pip install --no-deps trl==1.16.0   # its requirements are already met; --no-deps
                                                             # keeps pip from moving torch or transformers
    /work/bench-venv/bin/pip check

(``--bench-python`` or ``EASYTRAIN_BENCH_PYTHON`` points at another one.)
TRL's VLM path needs a Qwen-VL processor, which in transformers 5.x wants
torchvision for its video processor; torchvision does not work beside the
CPU torch here, so ``_trl_side.py`` builds the processor from Qwen's PIL
image processor and the tokenizer with no video processor.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.provenance import command_line, git_state, utc_now, write_result  # noqa: E402

RESULT = ROOT / "bench" / "results" / "trl_compare.json"
DEFAULT_BENCH_PYTHON = os.environ.get("EASYTRAIN_BENCH_PYTHON", "/work/bench-venv/bin/python")
ONE_WORKER = ["trainer.workers_per_node=1", "worker.actor.micro_batch_size_per_device_for_update=32",
              "worker.actor.micro_batch_size_per_device_for_experience=32"]
STEP_OPTIMISATIONS_OFF = ["worker.actor.share_prompt=false", "model.dedupe_images=false"]
VARIANTS = {
    # one fused worker process (actor, reference and rollout) using both cores (threads_per_worker's
    # default), all 32 sequences in one micro batch as TRL's per_device_train_batch_size=32 does
    "easytrain": ONE_WORKER,
    # two fused workers (FSDP2 over gloo), 16 sequences each
    "easytrain_2w": ["worker.actor.micro_batch_size_per_device_for_update=16",
                     "worker.actor.micro_batch_size_per_device_for_experience=16"],
    # as "easytrain" with the step optimisations switched off: what they are worth here
    "easytrain_plain": ONE_WORKER + STEP_OPTIMISATIONS_OFF,
    "trl": None,
}
FAMILY_OVERRIDES = {"qwen2_5_vl": [], "qwen2_vl": ["model.path=tiny:qwen2_vl"],
                    "qwen2": ["model.path=tiny:qwen2", "data.image_key=null"]}


def busy() -> dict[str, int]:
    def count(pattern: str) -> int:
        out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
        return len([p for p in out if int(p) != os.getpid()])
    return {"ray": count("ray::"), "pytest": count("pytest")}


def wait_quiet(max_wait: float) -> tuple[float, bool, dict[str, int]]:
    """Seconds waited, whether the machine was still busy, and what was running."""
    start = time.monotonic()
    while True:
        state = busy()
        if not any(state.values()):
            return time.monotonic() - start, False, state
        waited = time.monotonic() - start
        if waited >= max_wait:
            return waited, True, state
        # our own previous run's Ray processes take a few seconds to go; someone else's take longer
        time.sleep(5 if waited < 30 else 30)
        if waited >= 30:
            print(f"  machine busy ({state}); waiting ({waited:.0f} s so far)", flush=True)


class ForeignLoadWatch:
    """Polls, while a run goes on, for pytest or ``ray::`` processes that are not the run's own."""

    def __init__(self) -> None:
        self.own_root: Optional[int] = None
        self.seen: dict[str, int] = {"ray": 0, "pytest": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        while True:
            for key, pattern in (("ray", "ray::"), ("pytest", "pytest")):
                out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
                foreign = 0
                for pid in map(int, out):
                    try:
                        ancestors = {p.pid for p in psutil.Process(pid).parents()}
                    except psutil.Error:
                        continue  # gone already: a transient process, not load
                    if pid != os.getpid() and self.own_root not in ancestors:
                        foreign += 1
                self.seen[key] = max(self.seen[key], foreign)
            if self._stop.wait(3.0):
                return

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        return dict(self.seen)


class ThreadWatch:
    """Watches the Ray worker processes under a subprocess: their OMP_NUM_THREADS and compute threads.

    Ray sets ``OMP_NUM_THREADS`` inside an actor whose environment lacks it (to its CPU share, at least 1),
    after the process started, so ``/proc/<pid>/environ`` shows only a value inherited from the driver. The
    direct evidence is CPU time per OS thread: a worker's compute threads (its main thread and torch's
    intra-op pool) accumulate CPU time, Ray's gRPC and bookkeeping threads next to none. A thread counts as
    a compute thread when its CPU time is at least 10% of the busiest thread's.
    """

    def __init__(self, pid: int) -> None:
        self.pid, self.seen, self.cpu = pid, {}, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        while not self._stop.wait(1.0):
            try:
                children = psutil.Process(self.pid).children(recursive=True)
            except psutil.Error:
                continue
            for proc in children:
                try:
                    cmd = proc.cmdline()
                    if not cmd or not cmd[0].startswith("ray::") or "Worker" not in cmd[0]:
                        continue
                    # "ray::ActorWorker.update" or, once named, "ray::easytrain-actor-0-...:ActorWorker"
                    name = cmd[0].split()[0].split(":")[-1].split(".")[0]
                    entry = self.seen.setdefault(name, {"omp_num_threads_environ": set(), "os_threads_max": 0,
                                                        "processes": set()})
                    entry["omp_num_threads_environ"].add(proc.environ().get("OMP_NUM_THREADS"))
                    entry["os_threads_max"] = max(entry["os_threads_max"], proc.num_threads())
                    entry["processes"].add(proc.pid)
                    self.cpu[proc.pid] = (name, [t.user_time + t.system_time for t in proc.threads()])
                except psutil.Error:
                    continue

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join()
        compute: dict[str, list[int]] = {}
        for name, times in self.cpu.values():
            top = max(times, default=0.0)
            compute.setdefault(name, []).append(sum(t >= 0.1 * top for t in times) if top > 0 else 0)
        return {name: {"omp_num_threads_environ": sorted(str(v) for v in e["omp_num_threads_environ"]),
                       "os_threads_max": e["os_threads_max"], "processes": len(e["processes"]),
                       "compute_threads_per_process": sorted(compute.get(name, []))}
                for name, e in sorted(self.seen.items())}


def run_easytrain(size: str, family: str, variant: str, steps: int, warmup: int,
                  load: ForeignLoadWatch) -> dict[str, Any]:
    overrides = FAMILY_OVERRIDES[family] + VARIANTS[variant]
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, str(ROOT / "bench" / "grpo_step.py"), "--size", size, "--steps", str(steps),
                   "--warmup", str(warmup), "--out", str(out), *[f"--override={o}" for o in overrides]]
        start = time.perf_counter()
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        watch = ThreadWatch(proc.pid)
        load.own_root = proc.pid  # the run's own Ray processes are not foreign load
        log, _ = proc.communicate()
        threads = watch.stop()
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed ({proc.returncode}):\n{log[-4000:]}")
        result = json.loads(out.read_text())
    records = result["steps"]
    return {
        "median_step_s": result["median_step_s"],
        "median_tokens_per_s": statistics.median(r["generated_tokens"] / r["step_s"] for r in records),
        "median_generate_tokens_per_s": result["median_generated_tokens_per_s"],
        "median_generate_s": result["median_phase_s"].get("generate"),
        "median_phase_s": result["median_phase_s"],
        "median_orchestration_s": result["median_orchestration_s"],
        "generated_tokens_per_step": [r["generated_tokens"] for r in records],
        "steps_s": [round(r["step_s"], 4) for r in records],
        "worker_threads": threads,
        "overrides": overrides, "omp_num_threads_driver_env": env.get("OMP_NUM_THREADS"),
        "run_wall_s": round(wall, 1), "versions": result["versions"],
    }


def run_trl(size: str, family: str, folder: Path, steps: int, warmup: int, python: str,
            load: ForeignLoadWatch) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        command = [python, str(ROOT / "bench" / "_trl_side.py"), "--model", str(folder), "--family", family,
                   "--steps", str(steps), "--warmup", str(warmup), "--out", str(out)]
        start = time.perf_counter()
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
        result = json.loads(out.read_text())
    records = result["steps"]
    return {
        "median_step_s": result["median_step_s"],
        "median_tokens_per_s": result["median_tokens_per_s"],
        "median_generate_tokens_per_s": result["median_generate_tokens_per_s"],
        "median_generate_s": result["median_generate_s"],
        "median_inner_step_s": result["median_inner_step_s"],
        "generated_tokens_per_step": [r["generated_tokens"] for r in records],
        "steps_s": [round(r["step_s"], 4) for r in records],
        "torch_threads": result["torch_threads"], "processes": result["processes"],
        "processing_class": result["processing_class"], "trl_settings": result["settings"],
        "peak_rss_gb": result["peak_rss_gb"], "setup_s": result["setup_s"],
        "run_wall_s": round(wall, 1), "versions": result["versions"],
    }


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    median = statistics.median
    out: dict[str, Any] = {}
    for variant, results in runs.items():
        ok = [r for r in results if not r.get("disturbed")] or results
        out[variant] = {
            "runs": len(results), "runs_used": len(ok),
            "median_step_s": round(median(r["median_step_s"] for r in ok), 4),
            "median_tokens_per_s": round(median(r["median_tokens_per_s"] for r in ok), 1),
            "median_generate_tokens_per_s": round(median(r["median_generate_tokens_per_s"] for r in ok), 1),
            "median_generate_s": round(median(r["median_generate_s"] for r in ok), 4),
            "runs_step_s": [round(r["median_step_s"], 4) for r in results],
            "pooled_median_step_s": round(median(s for r in ok for s in r["steps_s"]), 4),
            "mean_generated_tokens_per_step": round(statistics.fmean(
                t for r in ok for t in r["generated_tokens_per_step"]), 1),
        }
    ratios: dict[str, Any] = {}
    if "trl" in out:
        trl = out["trl"]
        for variant, row in out.items():
            if variant == "trl":
                continue
            ratios[f"{variant}_vs_trl"] = {
                "step_rate": round(trl["median_step_s"] / row["median_step_s"], 3),
                "tokens_per_s": round(row["median_tokens_per_s"] / trl["median_tokens_per_s"], 3),
                "generate_tokens_per_s": round(row["median_generate_tokens_per_s"]
                                               / trl["median_generate_tokens_per_s"], 3),
            }
    return {"variants": out, "ratios": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["tiny", "small"], choices=["tiny", "small"])
    parser.add_argument("--family", default="qwen2_5_vl", choices=list(FAMILY_OVERRIDES))
    parser.add_argument("--variants", nargs="+", default=["easytrain", "easytrain_2w", "easytrain_plain", "trl"],
                        choices=list(VARIANTS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--bench-python", default=DEFAULT_BENCH_PYTHON,
                        help="python of the bench venv that has TRL (default: %(default)s)")
    parser.add_argument("--max-wait", type=float, default=600.0,
                        help="seconds to wait for a quiet machine before each run")
    parser.add_argument("--retries", type=int, default=2,
                        help="times a run disturbed by other processes is run again (it is kept, flagged, after)")
    parser.add_argument("--out", type=Path, default=RESULT)
    parser.add_argument("--fresh", action="store_true", help="do not keep other entries of --out")
    args = parser.parse_args()

    from easytrain.models.tiny import build_tiny, count_parameters

    command = command_line()
    previous: dict[str, Any] = {}
    if args.out.is_file() and not args.fresh:
        previous = json.loads(args.out.read_text())
    entries: dict[str, Any] = dict(previous.get("results", {}))
    for size in args.sizes:
        folder = build_tiny(args.family, size, seed=0)
        key = f"{args.family}/{size}"
        runs: dict[str, list[dict[str, Any]]] = {v: [] for v in args.variants}
        discarded: list[dict[str, Any]] = []
        for repeat in range(args.repeats):
            k = repeat % len(args.variants)
            for variant in args.variants[k:] + args.variants[:k]:  # rotate so no variant always follows another
                for attempt in range(1 + args.retries):
                    waited, still_busy, state = wait_quiet(args.max_wait)
                    load1 = os.getloadavg()[0]
                    load = ForeignLoadWatch()
                    if variant == "trl":
                        result = run_trl(size, args.family, folder, args.steps, args.warmup, args.bench_python, load)
                    else:
                        result = run_easytrain(size, args.family, variant, args.steps, args.warmup, load)
                    foreign = load.stop()
                    result.update({"repeat": repeat, "attempt": attempt, "waited_s": round(waited, 1),
                                   "busy_at_start": still_busy, "busy_state_at_start": state,
                                   "foreign_processes_during_run": foreign,
                                   "disturbed": still_busy or any(foreign.values()),
                                   "loadavg_1m_at_start": round(load1, 2)})
                    if not result["disturbed"]:
                        break
                    discarded.append({"variant": variant, **result})
                    print(f"  {variant} run {repeat + 1} disturbed by other processes ({foreign}); "
                          f"{'again' if attempt < args.retries else 'kept, flagged'}", flush=True)
                runs[variant].append(result)
                print(f"{key} {variant:16s} run {repeat + 1}: {result['median_step_s']:.3f} s/step, "
                      f"{result['median_tokens_per_s']:.0f} tok/s (wall {result['run_wall_s']} s)", flush=True)
        entry = {"command": command, "measured": utc_now(),
                 "model": f"tiny:{args.family} ({size})", "model_folder": str(folder),
                 "parameters": count_parameters(folder), "weights_sha256": sha256(folder / "model.safetensors"),
                 "repeats": args.repeats, "steps_per_run": args.steps, "warmup_steps_per_run": args.warmup,
                 "easytrain_git": git_state(), **summarise(runs), "runs": runs,
                 "discarded_runs": discarded}
        entries[key] = entry
        trl_versions = next((r["versions"] for r in runs.get("trl", [])), None)
        et_versions = next((r["versions"] for v, rs in runs.items() if v != "trl" for r in rs), None)
        commands = list(dict.fromkeys([*previous.get("commands", []), command]))
        previous_sides = previous.get("side_versions") or previous.get("versions", {})
        result_file = {
            "benchmark": "trl_compare",
            "commands": commands,
            "side_versions": {"easytrain_side": et_versions or previous_sides.get("easytrain_side"),
                              "trl_side": trl_versions or previous_sides.get("trl_side")},
            "settings": {"prompts_per_step": 8, "samples_per_prompt": 4, "new_tokens": 32, "kl_coef_beta": 0.04,
                         "kl_estimator": "k3 (easytrain low_var_kl; TRL's)", "kl_in_loss": True,
                         "loss": "token-mean (TRL loss_type=dapo)", "clip": [0.2, 0.28], "lr": 1e-3,
                         "dtype": "float32", "device": "cpu", "temperature": 1.0,
                         "data": "synthetic:shapes/colour, 128 train rows, seed 1, difficulty 0",
                         "reward": "easytrain answer reward on both sides",
                         "easytrain": "bench/grpo_step.py: local Ray, colocated actor/ref/rollout processes, HF "
                                      "engine; variants' overrides in VARIANTS and in each run's record",
                         "trl": "bench/_trl_side.py: GRPOTrainer, one process, HF generate, no vLLM, no "
                                "gradient checkpointing",
                         "step_s": "wall time of a whole step; median over a run's measured steps, then median "
                                   "over runs",
                         "tokens_per_s": "generated tokens of a step / its step time (end to end)",
                         "ratio": "step_rate = TRL s/step / easytrain s/step (>1: easytrain faster)"},
            "results": entries,
        }
        write_result(args.out, result_file)
        print(f"\n{key}: parameters {entry['parameters']:,}")
        for variant, row in entry["variants"].items():
            print(f"  {variant:16s} {row['median_step_s']:.3f} s/step  {row['median_tokens_per_s']:7.1f} tok/s  "
                  f"(generate phase {row['median_generate_tokens_per_s']:.0f} tok/s)  runs {row['runs_step_s']}")
        for name, ratio in entry["ratios"].items():
            print(f"  {name}: step rate {ratio['step_rate']}x, tokens/s {ratio['tokens_per_s']}x")
        print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}", flush=True)


if __name__ == "__main__":
    main()
