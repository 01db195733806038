"""One measurement for bench/planner_accuracy.py, in a fresh process: the peak RSS of an actor worker.

    .venv/bin/python bench/_memory_probe.py --empty
    .venv/bin/python bench/_memory_probe.py --overrides '["+exp=tiny", ...]' --phase update|old_log_probs

``--empty`` imports what a worker process imports (:func:`import_worker_modules`: torch, transformers,
the Qwen-VL model classes, peft, ray, easytrain's actor and data modules) and builds nothing: the
empty-worker baseline. Otherwise the probe composes the config as ``easytrain config`` does, builds a
prompt batch of exactly the configured shape (every prompt ``data.max_prompt_length`` tokens: images
at ``data.max_pixels`` plus random text tokens; every response ``data.max_response_length`` random
tokens, no EOS), creates ``ActorWorker(config, role="actor", rank=0, world_size=1)`` in this process
(no Ray, no process group: with one rank, fp32 and no offload FSDP is not applied) and runs ``setup``.
Then it resets the kernel's peak-RSS counter (``echo 5 > /proc/self/clear_refs`` resets VmHWM) and
runs the phase:

- update: ``worker.update(steps, kl_coef=0.0)`` (the driver's plan of the batch for one rank) over 2 optimizer
  steps (rollout batch = 2 x global batch). The counter is reset again after each optimizer step; the phase peak is the last step's
  (AdamW moments already exist: the steady state). Each step's peak is reported too.
- old_log_probs: AdamW moments are created first (one optimizer step on zero gradients, gradients
  then dropped), as every step after the first holds them; then ``worker.compute_log_probs(micro_batches)``.

The result is one line ``PROBE_RESULT {json}`` on stdout, bytes throughout.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULT_MARK = "PROBE_RESULT "
STATUS_FIELDS = ("VmHWM", "VmRSS", "RssAnon", "RssFile")


def status() -> dict[str, int]:
    """Peak and current resident memory of this process, from /proc/self/status, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in STATUS_FIELDS:
                out[key] = int(value.split()[0]) * 1024
    return out


def reset_peak() -> None:
    """Reset VmHWM to the current RSS (Linux: writing 5 to clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def import_worker_modules() -> None:
    """Everything the full probe imports (a config composed once loads Hydra's plugins), so that the
    empty baseline and a measurement differ only by what is built (model, optimizer, batch, activations)."""
    import PIL.Image  # noqa: F401
    import peft  # noqa: F401
    import ray  # noqa: F401
    import torch  # noqa: F401
    import transformers
    from transformers.models.qwen2 import modeling_qwen2  # noqa: F401
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl  # noqa: F401
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil, modeling_qwen2_vl  # noqa: F401

    import easytrain.workers.actor  # noqa: F401
    from easytrain.config import compose, with_default_preset
    from easytrain.data import collate, images, prompts  # noqa: F401
    from easytrain.main import resolve
    from easytrain.trainer.data import to_batch  # noqa: F401
    from easytrain.workers.sequences import assemble  # noqa: F401

    transformers.logging.set_verbosity_error()
    resolve(compose(with_default_preset([])))  # Hydra's plugins and the validation's imports load lazily


# ----------------------------------------------------------------------------- the batch


def filler_ids(tokenizer: Any, count: int, generator: Any) -> list[int]:
    """``count`` random ordinary (non-special) token ids of the tokenizer."""
    import torch

    special = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
    allowed = torch.tensor([i for i in range(len(tokenizer)) if i not in special])
    return allowed[torch.randint(len(allowed), (count,), generator=generator)].tolist()


def make_prompt(tokenizer: Any, cfg: Any, index: int, generator: Any) -> Any:
    """A prompt of exactly ``cfg.max_prompt_length`` tokens: ``cfg.limit_images`` noise images at
    ``cfg.max_pixels`` (square), the chat template, and random text tokens after the images."""
    import numpy as np
    from PIL import Image

    from easytrain.data.dataset import Prompt
    from easytrain.data.images import FACTOR, fit_image, vision_tokens
    from easytrain.data.prompts import build_messages, render_prompt

    side = math.isqrt(cfg.max_pixels) // FACTOR * FACTOR
    rng = np.random.default_rng(index)
    images = [fit_image(Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)),
                        cfg.min_pixels, cfg.max_pixels) for _ in range(cfg.limit_images)]
    rendered = render_prompt(tokenizer, build_messages("", len(images)), [vision_tokens(im.height, im.width)
                                                                          for im in images])
    ids = rendered.input_ids
    need = cfg.max_prompt_length - len(ids)
    if need < 0:
        raise SystemExit(f"images and template take {len(ids)} tokens > data.max_prompt_length")
    end = tokenizer.convert_tokens_to_ids("<|vision_end|>")
    at = max(i for i, t in enumerate(ids) if t == end) + 1 if images else len(ids) - 5
    ids = ids[:at] + filler_ids(tokenizer, need, generator) + ids[at:]
    return Prompt(uid=f"probe#{index}", input_ids=ids, vllm_text=rendered.vllm_text, images=images,
                  image_tokens=rendered.image_tokens, answer="0")


def build_batch(config: Any) -> Any:
    """The actor's training batch: prompts x n responses, as the trainer assembles it."""
    import torch

    from easytrain.data.collate import PromptCollator
    from easytrain.distributed.batch import Batch
    from easytrain.models.families.base import Bound
    from easytrain.models.hf import family, load_image_processor, load_tokenizer, model_folder
    from easytrain.trainer.data import to_batch
    from easytrain.workers.sequences import assemble

    d, n = config.data, config.worker.rollout.n
    folder = model_folder(config.model)
    tokenizer, processor = load_tokenizer(config.model, folder), load_image_processor(config.model, folder)
    processor.size = {"shortest_edge": d.min_pixels, "longest_edge": d.max_pixels}  # as RLData does
    generator = torch.Generator().manual_seed(0)
    prompts = [make_prompt(tokenizer, d, i, generator) for i in range(d.rollout_batch_size)]
    collator = PromptCollator(tokenizer.pad_token_id, Bound.of(family(folder), processor, tokenizer))
    prompt_batch = to_batch(collator(prompts), keep_images=False)
    rows, length = d.rollout_batch_size * n, d.max_response_length
    responses = torch.tensor(filler_ids(tokenizer, rows * length, generator)).view(rows, length)
    generated = Batch({"responses": responses, "response_mask": torch.ones(rows, length, dtype=torch.long)})
    batch = assemble(prompt_batch, generated, n, family(folder))
    extra = {"advantages": torch.randn(rows, 1, generator=generator).expand(rows, length).contiguous(),
             "old_log_probs": -5.0 + 0.1 * torch.randn(rows, length, generator=generator)}
    assert batch["input_ids"].shape == (rows, d.max_prompt_length + length), batch["input_ids"].shape
    return batch.union(Batch(extra))


# ----------------------------------------------------------------------------- the phases


def run_update(worker: Any, steps_of_micro_batches: Any) -> dict[str, Any]:
    """The update; the counter is reset after every optimizer step, so each step's peak is its own
    and the phase peak is the last step's (AdamW moments exist from the first step on)."""
    steps: list[dict[str, Any]] = []
    original: Callable[..., dict[str, float]] = worker._optimizer_step

    def step(mini: Any, kl_coef: float) -> dict[str, float]:
        start = time.perf_counter()
        out = original(mini, kl_coef)
        steps.append({**status(), "seconds": time.perf_counter() - start})
        reset_peak()
        return out

    worker._optimizer_step = step  # instance attribute: only this worker, only this probe
    worker.update(steps_of_micro_batches, kl_coef=0.0)
    assert len(steps) >= 2, f"expected at least 2 optimizer steps, ran {len(steps)}"
    return {"phase_peak": steps[-1]["VmHWM"], "first_step_peak": steps[0]["VmHWM"], "steps": steps}


def create_optimizer_states(worker: Any) -> None:
    """AdamW moments as a worker holds them from the second step on (then gradients dropped)."""
    import torch

    for p in worker.model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    worker.strategy.optimizer.step()
    worker.strategy.optimizer.zero_grad(set_to_none=True)


def measure(overrides: list[str], phase: str) -> dict[str, Any]:
    import torch

    from easytrain.config import compose, with_default_preset
    from easytrain.main import resolve
    from easytrain.trainer.micro_batches import Forward, log_prob_shares, update_shares
    from easytrain.workers.actor import ActorWorker

    times: dict[str, float] = {}
    after: dict[str, dict[str, int]] = {"imports": status()}
    t0 = time.perf_counter()
    config = resolve(compose(with_default_preset(overrides)))
    batch = build_batch(config)
    gc.collect()
    times["batch_s"] = time.perf_counter() - t0
    after["batch"] = status()
    t0 = time.perf_counter()
    worker = ActorWorker(config, role="actor", rank=0, world_size=1)
    sizes = worker.setup(config.data.rollout_batch_size // config.worker.actor.global_batch_size)
    times["setup_s"] = time.perf_counter() - t0
    after["setup"] = status()
    if phase == "old_log_probs":
        create_optimizer_states(worker)
        after["optimizer_states"] = status()
    gc.collect()
    reset_peak()
    t0 = time.perf_counter()
    # the micro batches as the driver plans them for one data-parallel member
    forward = Forward.of(config, sizes)
    per_step = config.worker.actor.global_batch_size * config.worker.rollout.n
    if phase == "update":
        result = run_update(worker, update_shares(batch, per_step, 1, config, forward)[0][0])
    else:
        worker.compute_log_probs(log_prob_shares(batch, 1, config, forward)[1][0])
        result = {"phase_peak": status()["VmHWM"]}
    times["phase_s"] = time.perf_counter() - t0
    after["phase"] = status()
    shape = {"sequences": int(batch["input_ids"].shape[0]), "tokens": int(batch["input_ids"].shape[1]),
             "images": int(batch["image_grid_thw"].shape[0]) if "image_grid_thw" in batch else 0,
             "patches": int(batch["pixel_values"].shape[0]) if "pixel_values" in batch else 0,
             "image_tokens": int((batch["mm_token_type_ids"] == 1).sum()) if "mm_token_type_ids" in batch else 0}
    return {"phase": phase, **result, "after": after, "times": times, "params": sizes, "batch": shape,
            "torch_threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--empty", action="store_true", help="imports only: the empty-worker baseline")
    parser.add_argument("--overrides", default="[]", help="JSON list of Hydra overrides")
    parser.add_argument("--phase", choices=("update", "old_log_probs"), default="update")
    args = parser.parse_args()
    start = time.perf_counter()
    import_worker_modules()
    imports_s = time.perf_counter() - start
    if args.empty:
        gc.collect()
        result: dict[str, Any] = {"empty": status()}
    else:
        result = measure(json.loads(args.overrides), args.phase)
    result.setdefault("times", {})["imports_s"] = imports_s
    result["times"]["total_s"] = time.perf_counter() - start
    sys.stdout.write(RESULT_MARK + json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
