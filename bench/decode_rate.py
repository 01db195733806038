"""The HF engine's decode paths side by side on the current device: plain ``generate``, easytrain's dynamic loop
(finished rows leave the batch) and the static-cache loop (on CUDA compiled into CUDA graphs).

    .venv/bin/python bench/decode_rate.py                      # a tiny Qwen2.5-VL, CUDA when there is one
    .venv/bin/python bench/decode_rate.py --model tiny:qwen2 --n 4 --max-new-tokens 64

It prints its figures and writes no result file: ``bench/gpu_step.py`` calls :func:`decode_rate` on its own
model and prompts and records them with its results.

Each path runs through a real :class:`~easytrain.workers.rollout.hf_engine.HFEngine` on the same model and
prompts, greedy: ``warmup`` untimed calls each (the static path compiles and records its graphs there), then
``repeats`` rounds of timed calls, the paths in turn, each call between ``torch.cuda.synchronize()`` calls.
Tokens/s = generated tokens (each response up to and including its stop token) / the median call time.
``generate`` is plain (each of the ``n`` rows prefilled, as TRL does); both easytrain loops prefill each prompt
once. ``static_fresh_cache`` is the static path with its cache dropped before every call, as in a fused worker
whose engine sleeps between rollouts (the graphs are recorded again for the new cache unless the allocator hands
back the same addresses; nothing is compiled again).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from easytrain.distributed.batch import Batch  # noqa: E402
from easytrain.workers.rollout.engine import SamplingParams  # noqa: E402
from easytrain.workers.rollout.hf_engine import HFEngine  # noqa: E402

logger = logging.getLogger(__name__)

PATHS = ("generate", "dynamic", "static", "static_fresh_cache")


def _engine(model: Any, path: str, stop_ids: list[int], pad_id: int, device: torch.device) -> HFEngine:
    return HFEngine(model, stop_ids, pad_id, device, static_cache="on" if path.startswith("static") else "off")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: torch.device, call: Callable[[], Batch]) -> tuple[Batch, float]:
    _sync(device)
    start = time.perf_counter()
    out = call()
    _sync(device)
    return out, time.perf_counter() - start


def _agreement(got: Batch, want: Batch) -> dict[str, Any]:
    """Greedy tokens of ``got`` against ``want``: all equal, the share of rows equal, the first step that differs."""
    a, b = got["responses"], want["responses"]
    width = max(a.shape[1], b.shape[1])
    a = torch.nn.functional.pad(a, (0, width - a.shape[1]), value=-1)
    b = torch.nn.functional.pad(b, (0, width - b.shape[1]), value=-1)
    same = a == b
    differ = (~same).any(0).nonzero()
    return {"equal": bool(same.all()), "rows_equal": round(float(same.all(-1).float().mean()), 4),
            "first_different_step": int(differ[0]) if len(differ) else None}


def decode_rate(model: Any, prompts: Batch, n: int, max_new_tokens: int, stop_ids: list[int], pad_id: int,
                repeats: int = 3, warmup: int = 2, paths: tuple[str, ...] = PATHS,
                device: Optional[torch.device] = None) -> dict[str, Any]:
    """Greedy tokens/s of each decode path on ``model`` (on its device) for ``prompts`` (a rollout ``Batch``:
    ``input_ids``, ``attention_mask`` and the images, left-padded) x ``n`` samples; whether each path's tokens
    equal plain ``generate``'s. Returns ``{path: {tokens, median_s, tokens_per_s, first_call_s}, "speedup":
    {path: x over generate}, "greedy_vs_generate": {path: {equal, rows_equal, first_different_step}}, ...}``.

    Exactness is a float32 claim: in bf16, kernels that sum in another order (inductor's fused ones, attention
    over a longer masked cache) can flip a near-tied argmax of a random model, after which a row's tokens part;
    ``rows_equal`` and ``first_different_step`` say how far. Check equality on a float32 copy of the model."""
    device = device or next(model.parameters()).device
    params = SamplingParams(n=n, temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=max_new_tokens, seed=0)
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                              "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
                              "prompts": len(prompts), "n": n, "max_new_tokens": max_new_tokens,
                              "prompt_tokens": int(prompts["input_ids"].shape[1])}
    engines = {path: _engine(model, path, stop_ids, pad_id, device) for path in paths}

    def call(path: str) -> Batch:
        engine = engines[path]
        if path == "static_fresh_cache" and engine.static is not None:
            engine.static.release()
        if path == "generate":  # transformers' own loop, each row prefilled
            return engine.transformers_generate(prompts, params)
        return engine.generate(prompts, params)

    first_s: dict[str, float] = {}
    for _ in range(warmup):  # the static path compiles its step and records its graphs here
        for path in paths:
            _, seconds = _timed(device, lambda: call(path))
            first_s.setdefault(path, seconds)
    times: dict[str, list[float]] = {path: [] for path in paths}
    outputs: dict[str, Batch] = {}
    for _ in range(repeats):  # the paths in turn, so that a slow spell of the machine hits them all
        for path in paths:
            outputs[path], seconds = _timed(device, lambda: call(path))
            times[path].append(seconds)
    for path in paths:
        median = statistics.median(times[path])
        tokens = int(outputs[path]["response_mask"].sum())
        result[path] = {"tokens": tokens, "steps": int(outputs[path]["responses"].shape[1]),
                        "median_s": round(median, 4), "tokens_per_s": round(tokens / median, 1),
                        "first_call_s": round(first_s.get(path, 0.0), 3), "runs_s": [round(t, 4) for t in times[path]]}
        static = engines[path].static
        if static is not None:
            result[path]["compiled"] = static.compiled
        logger.info("%s: %.1f tokens/s", path, tokens / median)
    if "generate" in outputs:
        base = result["generate"]["tokens_per_s"]
        result["speedup"] = {p: round(result[p]["tokens_per_s"] / base, 3) for p in outputs if p != "generate"}
        result["greedy_vs_generate"] = {p: _agreement(outputs[p], outputs["generate"]) for p in outputs
                                        if p != "generate"}
    return result


def measure_path(model_path: str, prompts: int, n: int, max_new_tokens: int, dtype: str, device: torch.device,
                 overrides: tuple[str, ...] = (), repeats: int = 3) -> dict[str, Any]:
    """:func:`decode_rate` for ``model.path=model_path`` on the synthetic task's first rollout batch (``overrides``
    choose the task, its images' size ...)."""
    from easytrain.config import load
    from easytrain.models.hf import load_model, model_folder
    from easytrain.trainer.data import RLData

    text = "qwen2" in model_path and "vl" not in model_path
    with tempfile.TemporaryDirectory() as out_dir:
        config = load([f"trainer.output_dir={out_dir}", f"model.path={model_path}", f"model.dtype={dtype}",
                       "data.num_workers=0", f"data.synthetic_size={max(16, prompts)}",
                       "data.synthetic_val_size=4", f"data.rollout_batch_size={prompts}",
                       f"worker.actor.global_batch_size={prompts}", f"worker.rollout.n={n}",
                       f"data.max_response_length={max_new_tokens}", "trainer.workers_per_node=1",
                       *(["data.image_key=null"] if text else []), *overrides])
        data = RLData(config)
        batch = next(data.train_batches())
        model = load_model(config.model, model_folder(config.model), device=str(device))
        tokenizer = data.tokenizer
        stop_ids = sorted({tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id} - {None})
        result = decode_rate(model, batch, n, max_new_tokens, stop_ids, tokenizer.pad_token_id, repeats=repeats,
                             device=device)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def measure_folder(folder: Path, task: str, difficulty: int, shape: dict[str, int], max_new_tokens: int) -> dict:
    """bench/gpu_step.py's decode part: its model in bfloat16 on CUDA, its task and image size."""
    pixels = shape["pixels"]
    return measure_path(str(folder), shape["prompts"], shape["n"], max_new_tokens, "bfloat16", torch.device("cuda"),
                        (f"data.train_files=synthetic:{task}", f"data.synthetic_difficulty={difficulty}",
                         f"data.min_pixels={pixels}", f"data.max_pixels={pixels}", "data.max_prompt_length=512"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny:qwen2_5_vl", help="model.path (tiny:<family> or a folder)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default=None, help="model.dtype (default: bfloat16 on CUDA, float32 on CPU)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    result = measure_path(args.model, args.prompts, args.n, args.max_new_tokens, dtype, torch.device(args.device),
                          repeats=args.repeats)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
