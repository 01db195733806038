"""GRPO on one GPU, easytrain beside TRL's GRPOTrainer: step rate, phases, sync, decode, MFU, memory (issue 32).

    # on a CUDA machine (Ray and Hydra carried: bash ../shared/gpu/bundle.sh --with-trl; source .gpu/setup.sh)
    python bench/gpu_step.py                       # both shapes -> bench/results/gpu_step.json
    python bench/gpu_step.py --shapes small --steps 3 --warmup 1

Without CUDA it writes nothing and exits 2: its figures exist only where they were measured. What runs:

- the model: ``random:qwen25vl_3b`` (Qwen2.5-VL-3B's shape, 3.45B parameters, random weights, easytrain's
  tiny tokenizer), initialised once on the GPU and saved in bfloat16 into the easytrain cache, so both trainers
  load the same bytes from the same folder;
- two shapes of the synthetic square-counting task (``synthetic:shapes/count``, difficulty 1): ``small``,
  56 x 56 images (4 vision tokens), 8 prompts x 4 responses; ``image_heavy``, 448 x 448 images (256 vision
  tokens), 4 prompts x 8; 32 new tokens, temperature 1, a reference model with KL coefficient 0.04 (k3), token-mean
  loss, clip 0.2 / 0.28, AdamW lr 1e-6, bfloat16, gradient checkpointing, every sequence of a step in one
  micro batch, one optimizer step per rollout batch;
- ``easytrain``: the real trainer (local Ray, one fused worker on the GPU hosting actor, reference and HF
  engine; ``bench/grpo_step.py``'s ``measure``), in a subprocess per shape; ``easytrain_vllm`` the same with
  ``worker.rollout.engine=vllm`` where vLLM imports;
- ``trl``: ``bench/_trl_side.py`` (TRL's ``GRPOTrainer``, one process) with the same folder, rows, image size and
  settings, where ``trl`` imports (a benchmark peer, never a dependency);
- ``sync``: easytrain's weight sync (the trainer's ``sync/seconds``) against one device-to-device copy of the
  model's bfloat16 weights (``torch.Tensor.copy_`` of one buffer that size, best of 5); the goal is 2x;
- ``decode``: plain ``generate`` against easytrain's decode loops on the same model and prompts
  (``bench/decode_rate.py``), with whether greedy tokens agree;
- MFU of the update: 6 x parameters x the update's tokens (prompt and response) / the update's seconds / the
  card's dense bfloat16 peak (``easytrain.trainer.mfu``).

Each side discards ``--warmup`` steps and reports the median of ``--steps``. The ratio is easytrain's step rate
over TRL's (TRL's seconds per step / easytrain's); the goals are 1.5x (small) and 2.5x (image_heavy).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.provenance import write_result  # noqa: E402

log = logging.getLogger("gpu_step")
RESULTS = ROOT / "bench" / "results" / "gpu_step.json"
MODEL = "qwen25vl_3b"
SHAPES: dict[str, dict[str, int]] = {
    "small": {"prompts": 8, "n": 4, "pixels": 56 * 56},
    "image_heavy": {"prompts": 4, "n": 8, "pixels": 448 * 448},
}
"""Each shape: prompts per step, responses per prompt, and every image's pixels (resized to exactly that)."""
GOALS = {"small": 1.5, "image_heavy": 2.5}
"""Issue 32: easytrain's step rate over TRL's, per shape."""
SYNC_GOAL = 2.0
"""Issue 32: the sync within this many device copies of the model's bfloat16 weights."""
TASK, DIFFICULTY, NEW_TOKENS, BETA, LR = "shapes/count", 1, 32, 0.04, 1e-6


def model_folder() -> Path:
    """random:qwen25vl_3b with weights: initialised on the GPU by transformers and saved in bfloat16, once."""
    import torch

    from easytrain.models.random_init import MARKER, build_random, random_model
    from easytrain.models.tiny import default_cache_dir

    shape = build_random(MODEL)
    folder = default_cache_dir() / f"gpu_step_{MODEL}_{shape.name}"
    if (folder / "model.safetensors.index.json").is_file() or (folder / "model.safetensors").is_file():
        (folder / MARKER).unlink(missing_ok=True)  # a folder saved before the marker was left out
        return folder
    tmp = folder.with_name(f".{folder.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model = random_model(shape, torch.bfloat16, "sdpa", "cuda")
    model.save_pretrained(tmp)
    for file in shape.iterdir():  # tokenizer, chat template, image processor (the random folder's config stays)
        # not its random_init.json marker: with it, easytrain would build new random weights instead of loading these
        if file.name != MARKER and not (tmp / file.name).exists():
            shutil.copy(file, tmp / file.name)
    del model
    torch.cuda.empty_cache()
    tmp.rename(folder)
    return folder


def parameters(folder: Path) -> int:
    """Parameters of the saved model, from its safetensors headers (nothing loaded)."""
    from safetensors import safe_open

    total = 0
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                total += math.prod(f.get_slice(name).get_shape())
    return total


def easytrain_overrides(folder: Path, shape: str, engine: str, out_dir: str, steps: int,
                        device: str = "cuda") -> list[str]:
    """The trainer's settings for a shape (``device=cpu``, float32: the CPU smoke test of this script's wiring)."""
    s = SHAPES[shape]
    sequences = s["prompts"] * s["n"]
    dtype = "bfloat16" if device == "cuda" else "float32"
    return [f"model.path={folder}", f"trainer.device={device}", "trainer.workers_per_node=1", f"model.dtype={dtype}",
            "model.gradient_checkpointing=true", f"data.train_files=synthetic:{TASK}", "data.val_files=null",
            f"data.synthetic_difficulty={DIFFICULTY}", "data.synthetic_size=128", f"data.min_pixels={s['pixels']}",
            f"data.max_pixels={s['pixels']}", "data.max_prompt_length=512", f"data.max_response_length={NEW_TOKENS}",
            f"data.rollout_batch_size={s['prompts']}", f"worker.rollout.n={s['n']}",
            f"worker.actor.global_batch_size={s['prompts']}",
            f"worker.actor.micro_batch_size_per_device_for_update={sequences}",
            f"worker.actor.micro_batch_size_per_device_for_experience={sequences}",
            f"algorithm.kl_coef={BETA}", f"worker.actor.optim.lr={LR}", f"worker.rollout.engine={engine}",
            "data.num_workers=0", "ray.include_dashboard=false", "trainer.val_freq=-1", "trainer.save_freq=0",
            "trainer.val_before_train=false", "trainer.loggers=[jsonl]", f"trainer.output_dir={out_dir}",
            f"trainer.max_steps={steps}", "trainer.memory_check=warn"]


def run_easytrain_side(args: argparse.Namespace) -> None:
    """One shape through the real trainer, in this process (started by :func:`side` as a subprocess)."""
    import ray

    from bench.grpo_step import measure
    from easytrain.config import load
    from easytrain.distributed.cluster import init_ray

    out_dir = tempfile.mkdtemp(prefix="easytrain-gpu-step-")
    config = load(easytrain_overrides(args.model, args.shape, args.engine, out_dir, args.warmup + args.steps,
                                      args.device))
    init_ray(config.ray)
    records, memory = measure(config, args.steps, args.warmup)
    ray.shutdown()
    median = statistics.median
    metric = lambda key: median(r["metrics"].get(key, 0.0) for r in records)  # noqa: E731
    summary = {
        "median_step_s": median(r["step_s"] for r in records),
        "median_phase_s": {p: median(r["phases_s"].get(p, 0.0) for r in records) for p in records[0]["phases_s"]},
        "median_orchestration_s": median(r["orchestration_s"] for r in records),
        "median_generated_tokens_per_s": median(r["tokens_per_s"] for r in records),
        "median_sync_s": metric("sync/seconds"), "median_update_tokens": metric("perf/update_tokens"),
        "gpu_peak_gb": max(m.get("gpu_peak_gb", 0.0) for readings in memory.values() for m in readings),
        "host_peak_rss_gb": max(m["peak_rss_gb"] for readings in memory.values() for m in readings),
        "steps": [{k: v for k, v in r.items() if k != "metrics"} for r in records],
    }
    args.out.write_text(json.dumps(summary, indent=2) + "\n")


def side(kind: str, folder: Path, shape: str, steps: int, warmup: int, timeout_s: int) -> dict[str, Any]:
    """One side of one shape in a fresh process (the GPU to itself); its summary, or why it did not run."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "side.json"
        s = SHAPES[shape]
        if kind == "trl":
            command = [sys.executable, str(ROOT / "bench" / "_trl_side.py"), "--model", str(folder), "--family",
                       "qwen2_5_vl", "--device", "cuda", "--bf16", "--gradient-checkpointing", "--task", TASK,
                       "--difficulty", str(DIFFICULTY), "--min-pixels", str(s["pixels"]), "--max-pixels",
                       str(s["pixels"]), "--prompts", str(s["prompts"]), "--n", str(s["n"]), "--new-tokens",
                       str(NEW_TOKENS), "--beta", str(BETA), "--lr", str(LR), "--steps", str(steps), "--warmup",
                       str(warmup), "--out", str(out)]
        else:
            command = [sys.executable, str(Path(__file__)), "--side", kind, "--shape", shape, "--model", str(folder),
                       "--steps", str(steps), "--warmup", str(warmup), "--out", str(out)]
        log.info("%s %s: %s", kind, shape, " ".join(command))
        return json_child(command, out, timeout_s, f"did not finish within {timeout_s} s")


def json_child(command: list[str], out: Path, timeout_s: float, timed_out: str) -> dict[str, Any]:
    """Run ``command`` (which writes its result as JSON to ``out``) for at most ``timeout_s``: its result, or
    ``failed`` (``timed_out``, or its exit status with its output's tail)."""
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"failed": timed_out}
    if done.returncode != 0 or not out.is_file():
        return {"failed": f"exit {done.returncode}", "log_tail": (done.stdout + done.stderr)[-3000:]}
    return json.loads(out.read_text())


def device_copy_s(nbytes: int, repeats: int = 5) -> float:
    """The best time of one device-to-device copy of ``nbytes`` (one buffer, ``copy_``), timed by CUDA events."""
    import torch

    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats + 1):  # the first warms the copy engine up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1000)
    del src, dst
    torch.cuda.empty_cache()
    return best


def decode_part(folder: Path) -> dict[str, Any]:
    """Tokens per second of ``generate`` and easytrain's decode loops on the small shape's prompts."""
    try:
        from bench.decode_rate import measure_folder
    except ImportError as err:
        return {"skipped": f"bench/decode_rate.py: {err}"}
    return measure_folder(folder, TASK, DIFFICULTY, SHAPES["small"], NEW_TOKENS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per side and shape")
    parser.add_argument("--side", choices=["easytrain", "easytrain_vllm"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--shape", choices=list(SHAPES), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.side is not None:  # a subprocess of this script: one side of one shape
        args.engine = "vllm" if args.side == "easytrain_vllm" else "hf"
        run_easytrain_side(args)
        return

    import torch

    if not torch.cuda.is_available():
        log.error("bench/gpu_step.py measures on a CUDA device and this machine has none: nothing written")
        sys.exit(2)
    from bench.gpu_smoke import device
    from easytrain.trainer.mfu import peak_bf16_flops, update_mfu

    folder = model_folder()
    params = parameters(folder)
    peak = peak_bf16_flops(torch.cuda.get_device_name(0))
    kinds = ["easytrain"] + (["easytrain_vllm"] if importlib.util.find_spec("vllm") else [])
    kinds += ["trl"] if importlib.util.find_spec("trl") else []
    shapes: dict[str, Any] = {}
    for shape in args.shapes:
        found = {kind: side(kind, folder, shape, args.steps, args.warmup, args.timeout) for kind in kinds}
        if "trl" not in found:
            found["trl"] = {"skipped": "trl is not installed (bash ../shared/gpu/bundle.sh --with-trl)"}
        mine, theirs = found["easytrain"], found["trl"]
        if "median_step_s" in mine:
            update_s = mine["median_phase_s"].get("update", 0.0)
            mine["update_mfu"] = (update_mfu(params, mine["median_update_tokens"], update_s, peak)
                                  if peak and update_s else None)
        ratio: Optional[float] = None
        if "median_step_s" in mine and "median_step_s" in theirs:
            ratio = theirs["median_step_s"] / mine["median_step_s"]
        shapes[shape] = {"settings": {**SHAPES[shape], "task": TASK, "difficulty": DIFFICULTY,
                                      "new_tokens": NEW_TOKENS, "beta": BETA, "lr": LR, "dtype": "bfloat16",
                                      "gradient_checkpointing": True},
                         **found, "step_rate_vs_trl": ratio, "goal": GOALS[shape],
                         "goal_met": None if ratio is None else ratio >= GOALS[shape]}
        log.info("%s: easytrain %s s/step, TRL %s s/step, ratio %s", shape, mine.get("median_step_s"),
                 theirs.get("median_step_s"), ratio)
    model_bytes = params * 2
    copy_s = device_copy_s(model_bytes)
    syncs = [shapes[s]["easytrain"].get("median_sync_s") for s in shapes if "easytrain" in shapes[s]]
    sync_s = min((s for s in syncs if s), default=None)
    result = {
        "benchmark": "gpu_step", "device": device(), "model": {"name": f"random:{MODEL}", "folder": str(folder),
                                                              "parameters": params, "bf16_bytes": model_bytes},
        "peak_bf16_flops": peak, "shapes": shapes,
        "sync": {"device_copy_s": copy_s, "sync_s": sync_s, "ratio": sync_s / copy_s if sync_s else None,
                 "goal": SYNC_GOAL, "goal_met": None if sync_s is None else sync_s / copy_s <= SYNC_GOAL},
        "decode": decode_part(folder),
        "settings": {"steps": args.steps, "warmup": args.warmup},
    }
    write_result(RESULTS, result)
    print(json.dumps({s: {"easytrain_s": v["easytrain"].get("median_step_s"), "trl_s": v["trl"].get("median_step_s"),
                          "ratio": v["step_rate_vs_trl"]} for s, v in shapes.items()}, indent=2))
    print(f"sync {sync_s} s vs a device copy {copy_s:.4f} s; wrote {RESULTS}")


if __name__ == "__main__":
    main()
