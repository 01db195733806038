"""The memory planner against the real peak memory of an actor worker process, on this machine.

    .venv/bin/python bench/planner_accuracy.py                  # measure all, score -> bench/results/planner_accuracy.json
    .venv/bin/python bench/planner_accuracy.py --measure-only   # measure, no predictions
    .venv/bin/python bench/planner_accuracy.py --rescore        # predictions only, measured values from the file
    .venv/bin/python bench/planner_accuracy.py --only NAME      # (re)measure one case, keep the others' from the file

Each measurement is a fresh process (bench/_memory_probe.py) that builds
``ActorWorker(config, role="actor", rank=0, world_size=1)`` directly (no Ray),
runs ``setup``, resets the kernel's peak-RSS counter and runs one phase on a
batch of exactly the configured shape: ``update`` (2 optimizer steps, the
second one's peak counts) or ``old_log_probs``. ``measured`` is that phase peak
(VmHWM) minus the VmHWM of an empty worker process (same imports, nothing
built), measured the same way; ``predicted`` is
``easytrain.memory.planner.worker_bytes(config, "actor", phase)``. The goal:
every prediction within 15% of the measurement. Half of the cases are tagged
``calibration`` (what the planner may be tuned on), half ``held_out``.

Two models: the tiny factory's ``small`` Qwen2.5-VL (~4M parameters) and a
random ~180M-parameter Qwen2.5-VL (:data:`BENCH_TEXT`, :data:`BENCH_VISION`,
the tiny tokenizer and processor) written once into
``~/.cache/easytrain/bench_planner_<hash>``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.provenance import write_result  # noqa: E402

PROBE = ROOT / "bench" / "_memory_probe.py"
RESULTS = ROOT / "bench" / "results" / "planner_accuracy.json"
RESULT_MARK = "PROBE_RESULT "
GOAL = 0.15
GB = 10**9
BENCH_MODEL = "{bench_model}"
"""Placeholder in the overrides for the folder of the ~180M model (machine-specific)."""
BENCH_TEXT = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 2,
              "intermediate_size": 3072, "vocab_size": 32000}
BENCH_VISION = {"depth": 8, "hidden_size": 512, "num_heads": 8, "intermediate_size": 1536, "out_hidden_size": 768,
                "fullatt_block_indexes": [3, 7]}
EMPTY_RUNS = 3
ALLOCATORS = {"glibc_default": {}, "mmap_threshold_64k": {"MALLOC_MMAP_THRESHOLD_": "65536"}}
"""Each case runs under glibc's default malloc (its mmap threshold grows with the blocks freed, so freed
activation memory below 32 MB stays in the heap and in RSS) and with a fixed 64 KiB mmap threshold (blocks
above it go back to the OS when freed, so RSS follows the live tensors). The planner prices live bytes."""
LIVE = "mmap_threshold_64k"

BASE = ["+exp=tiny", "trainer.device=cpu", "model.dtype=float32", "data.num_workers=0", "trainer.nnodes=1",
        "trainer.workers_per_node=1", "worker.rollout.n=2", "data.limit_images=1", "data.max_pixels=50176"]
SMALL = ["model.path=tiny:qwen2_5_vl", "model.tiny_size=small"]
MID = [f"model.path={BENCH_MODEL}"]


def shape(prompt: int, response: int, prompts_per_step: int, micro: int) -> list[str]:
    """Sequence lengths and 2 optimizer steps of ``prompts_per_step`` x n=2 sequences, ``micro`` at a time."""
    return [f"data.max_prompt_length={prompt}", f"data.max_response_length={response}",
            f"worker.actor.global_batch_size={prompts_per_step}", f"data.rollout_batch_size={2 * prompts_per_step}",
            f"worker.actor.micro_batch_size_per_device_for_update={micro}"]


@dataclass(frozen=True)
class Case:
    name: str
    tag: str
    """calibration or held_out."""
    phase: str
    """update or old_log_probs."""
    overrides: list[str]


CASES = [
    Case("small_384_mb1", "calibration", "update", SMALL + shape(256, 128, 2, 1)),
    Case("small_384_mb4", "held_out", "update", SMALL + shape(256, 128, 2, 4)),
    Case("small_1536_mb2", "calibration", "update", SMALL + shape(1024, 512, 2, 2)),
    Case("small_1536_mb4", "held_out", "update", SMALL + shape(1024, 512, 2, 4)),
    Case("small_1536_mb4_ckpt", "held_out", "update", SMALL + shape(1024, 512, 2, 4)
         + ["model.gradient_checkpointing=true"]),
    Case("small_2img_1024_mb2", "calibration", "update", SMALL + shape(768, 256, 2, 2)
         + ["data.limit_images=2", "data.max_pixels=200704"]),
    Case("mid_384_mb1", "calibration", "update", MID + shape(256, 128, 1, 1)),
    Case("mid_768_mb2", "held_out", "update", MID + shape(512, 256, 1, 2)),
    Case("mid_768_mb2_ckpt", "calibration", "update", MID + shape(512, 256, 1, 2)
         + ["model.gradient_checkpointing=true"]),
    Case("mid_768_mb2_lora16", "held_out", "update", MID + shape(512, 256, 1, 2) + ["model.lora.rank=16"]),
    Case("small_1536_logprobs_mb4", "calibration", "old_log_probs", SMALL + shape(1024, 512, 2, 4)
         + ["worker.actor.micro_batch_size_per_device_for_experience=4"]),
    Case("mid_768_logprobs_mb4", "held_out", "old_log_probs", MID + shape(512, 256, 2, 2)
         + ["worker.actor.micro_batch_size_per_device_for_experience=4"]),
]


def overrides_of(case: Case, folder: Path) -> list[str]:
    return [o.replace(BENCH_MODEL, str(folder)) for o in BASE + case.overrides]


# ----------------------------------------------------------------------------- the ~180M model


def bench_model_folder() -> Path:
    """A random Qwen2.5-VL of ~180M parameters with the tiny factory's tokenizer, processor and token
    ids, saved once with ``save_pretrained`` into the easytrain cache."""
    import torch
    import transformers

    from easytrain.models.tiny import build_tiny, default_cache_dir

    tiny = build_tiny("qwen2_5_vl", "small")
    raw = json.loads((tiny / "config.json").read_text())
    for key in ("architectures", "transformers_version", "dtype"):
        raw.pop(key, None)
    raw["text_config"].pop("layer_types", None)  # one per layer: rebuilt for the new depth
    raw["text_config"].update(BENCH_TEXT)
    raw["vision_config"].update(BENCH_VISION)
    raw["tie_word_embeddings"] = False
    key = hashlib.sha1(json.dumps([raw, tiny.name, transformers.__version__], sort_keys=True).encode()).hexdigest()
    folder = default_cache_dir() / f"bench_planner_{key[:10]}"
    if (folder / "config.json").is_file():
        return folder
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    config = transformers.AutoConfig.for_model(raw.pop("model_type"), **raw)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.Qwen2_5_VLForConditionalGeneration(config).to(torch.float32)
    model.save_pretrained(tmp)
    for file in tiny.iterdir():  # tokenizer, chat template, image processor, generation config
        if file.name not in ("config.json", "model.safetensors"):
            shutil.copy(file, tmp / file.name)
    os.replace(tmp, folder)
    return folder


# ----------------------------------------------------------------------------- measuring


def run_probe(args: list[str], allocator: str) -> dict[str, Any]:
    """One fresh probe process under ``allocator``'s malloc settings; its result line as a dict."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", **ALLOCATORS[allocator])
    proc = subprocess.run([sys.executable, str(PROBE), *args], capture_output=True, text=True, env=env, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_MARK)]
    if proc.returncode or not lines:
        raise RuntimeError(f"probe {args} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return dict(json.loads(lines[-1][len(RESULT_MARK):]))


def measure_baseline(allocator: str) -> dict[str, Any]:
    runs = [run_probe(["--empty"], allocator)["empty"] for _ in range(EMPTY_RUNS)]
    return {"VmHWM": int(statistics.median(r["VmHWM"] for r in runs)), "runs": runs}


def measure_case(case: Case, folder: Path, allocator: str) -> dict[str, Any]:
    start = time.perf_counter()
    probe = run_probe(["--overrides", json.dumps(overrides_of(case, folder)), "--phase", case.phase], allocator)
    probe["wall_s"] = time.perf_counter() - start
    return probe


# ----------------------------------------------------------------------------- scoring


def predict(case: Case, folder: Path) -> tuple[Optional[int], Optional[str]]:
    """The planner's bytes for the case, or None and why not."""
    from easytrain.config import compose, with_default_preset
    from easytrain.main import resolve

    config = resolve(compose(with_default_preset(overrides_of(case, folder))))
    try:
        from easytrain.memory.planner import worker_bytes

        return int(worker_bytes(config, "actor", case.phase)), None
    except (ImportError, AttributeError) as err:
        return None, f"planner missing: {err}"
    except Exception as err:  # a planner in progress: report, keep scoring the others
        return None, f"{type(err).__name__}: {err}"


def score(rows: list[dict[str, Any]], baselines: dict[str, int], folder: Path, with_predictions: bool) -> None:
    """Fill measured bytes (per allocator), predictions and errors into ``rows`` (in place); ``error`` is
    against the live-tracking allocator, ``error_glibc_default`` against glibc's default."""
    cases = {c.name: c for c in CASES}
    for row in rows:
        row["measured"] = {name: row["probes"][name]["phase_peak"] - baselines[name] for name in row["probes"]}
        row["measured_bytes"] = row["measured"][LIVE]
        row["predicted_bytes"], row["prediction_note"], row["error"] = None, None, None
        if with_predictions:
            row["predicted_bytes"], row["prediction_note"] = predict(cases[row["name"]], folder)
        if row["predicted_bytes"] is not None:
            row["error"] = (row["predicted_bytes"] - row["measured_bytes"]) / row["measured_bytes"]
            default = row["measured"]["glibc_default"]
            row["error_glibc_default"] = (row["predicted_bytes"] - default) / default


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def worst(tag: Optional[str]) -> Optional[float]:
        errors = [abs(r["error"]) for r in rows if r["error"] is not None and tag in (None, r["tag"])]
        return max(errors) if errors else None

    complete = bool(rows) and all(r["error"] is not None for r in rows)
    worst_all = worst(None)
    default = [abs(r["error_glibc_default"]) for r in rows if r.get("error_glibc_default") is not None]
    return {"max_abs_error": {"all": worst_all, "held_out": worst("held_out"), "calibration": worst("calibration"),
                              "all_glibc_default": max(default) if default else None},
            "goal": {"text": f"every prediction within {GOAL:.0%}", "threshold": GOAL,
                     "met": (complete and worst_all is not None and worst_all <= GOAL) if complete else None,
                     "predictions": sum(r["error"] is not None for r in rows), "cases": len(rows)}}


def table(rows: list[dict[str, Any]]) -> str:
    def gb(value: Optional[int]) -> str:
        return f"{value / GB:7.3f}" if value is not None else "      -"

    head = (f"{'case':26} {'tag':11} {'phase':13} {'live':>7} {'default':>7} {'predicted':>9} {'error':>7} "
            f"{'err(def)':>8}")
    lines = [f"GB (1e9 bytes) above the empty worker; live = measured with a fixed 64 KiB mmap threshold "
             f"(RSS follows live tensors), default = glibc's default malloc", head, "-" * len(head)]

    def pct(value: Optional[float]) -> str:
        return f"{100 * value:+6.1f}%" if value is not None else "      -"

    for r in rows:
        lines.append(f"{r['name']:26} {r['tag']:11} {r['phase']:13} {gb(r['measured'][LIVE])} "
                     f"{gb(r['measured']['glibc_default'])} {gb(r['predicted_bytes']):>9} {pct(r['error'])} "
                     f"{pct(r.get('error_glibc_default')):>8}")
    notes = sorted({r["prediction_note"] for r in rows if r["prediction_note"]})
    return "\n".join(lines + [f"note: {n}" for n in notes])


# ----------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", default=[], help="case name (repeatable); others kept from the file")
    parser.add_argument("--measure-only", action="store_true", help="measure, skip the planner's predictions")
    parser.add_argument("--rescore", action="store_true", help="re-predict only; measurements from the results file")
    args = parser.parse_args()
    unknown = set(args.only) - {c.name for c in CASES}
    if unknown:
        parser.error(f"unknown case(s) {sorted(unknown)}; cases: {', '.join(c.name for c in CASES)}")
    start = time.perf_counter()
    folder = bench_model_folder()
    old = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    kept = {r["name"]: r for r in old.get("rows", [])}
    if args.rescore:
        if not kept:
            parser.error(f"--rescore needs measurements in {RESULTS}")
        baselines = old["baselines"]
    else:
        baselines = {}
        for allocator in ALLOCATORS:
            print(f"measuring the empty worker ({allocator}) ...", flush=True)
            baselines[allocator] = measure_baseline(allocator)
        for case in CASES:
            if args.only and case.name not in args.only:
                continue
            probes = {}
            for allocator in ALLOCATORS:
                print(f"measuring {case.name} ({allocator}) ...", flush=True)
                probes[allocator] = measure_case(case, folder, allocator)
            kept[case.name] = {"name": case.name, "tag": case.tag, "phase": case.phase,
                               "overrides": BASE + case.overrides, "probes": probes}
    rows = []
    for case in CASES:
        row = kept.get(case.name)
        if row is None:
            continue
        if row["overrides"] != BASE + case.overrides or row["phase"] != case.phase or "probes" not in row:
            print(f"{case.name}: stored measurement is for other overrides; re-measure it (--only {case.name})")
            continue
        rows.append({**row, "tag": case.tag})
    score(rows, {name: b["VmHWM"] for name, b in baselines.items()}, folder, with_predictions=not args.measure_only)
    print(table(rows))
    reused = args.rescore or bool(args.only)  # measurements kept from the previous file: say which one
    result = {"measurements_reused_from": {k: old.get(k) for k in ("commit", "date", "command")} if reused else None,
              "bench_model": {"folder": str(folder), "placeholder": BENCH_MODEL, "text": BENCH_TEXT,
                              "vision": BENCH_VISION, "tie_word_embeddings": False},
              "allocators": ALLOCATORS, "baselines": baselines,
              "calibrated_constants": "none: the planner has no constant fitted to these measurements",
              **summary(rows), "rows": rows,
              "wall_s": time.perf_counter() - start if not args.rescore else old.get("wall_s")}
    write_result(RESULTS, result, indent=1)
    goal = result["goal"]
    print(f"max |error|: all {result['max_abs_error']['all']}, held_out {result['max_abs_error']['held_out']}; "
          f"goal ({goal['text']}): {'met' if goal['met'] else 'not met' if goal['met'] is False else 'not scored'}"
          f"; wall {time.perf_counter() - start:.0f} s -> {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
