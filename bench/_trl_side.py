"""TRL's side of ``bench/trl_compare.py``: GRPO steps of Hugging Face TRL's ``GRPOTrainer``, timed.

Runs in the bench environment only (TRL is not an easytrain dependency; see
``bench/trl_compare.py`` for how that venv is made), normally started by
``bench/trl_compare.py``; by hand:

    /work/bench-venv/bin/python bench/_trl_side.py --model ~/.cache/easytrain/tiny/<folder> \\
        --family qwen2_5_vl --steps 6 --warmup 2 --out /tmp/trl.json

The setting mirrors ``bench/grpo_step.py``: the same tiny model folder (built
by easytrain's factory, passed in by path, so the weights are the same bytes),
the same synthetic rows (``easytrain.data.synthetic``: the colour question,
difficulty 0, 128 train rows, seed 1; the image itself, or the text-only
variant for ``qwen2``), easytrain's ``answer`` reward function called as a TRL
reward, 8 prompts x 4 samples per optimizer step (one generation batch of 32
completions, one optimizer step per generation, so no old-log-prob pass),
32 new tokens, temperature 1, a reference model with beta 0.04 (k3 KL, as
easytrain's ``low_var_kl``), the token-mean loss (``dapo``) with clip
0.2 / 0.28, AdamW lr 1e-3, weight decay 0.01, grad-norm clip 1.0, fp32 (bf16
and gradient checkpointing off: TRL turns both on by default), HF generate (no
vLLM), one process on CPU.

Step time is the wall time between consecutive ``on_step_end`` callbacks: the
whole loop (fetching the batch, generation, reference and reward, the update,
TRL's own bookkeeping). The first step is timed from ``on_step_begin``. The
generation phase is timed by wrapping ``GRPOTrainer._generate_single_turn``
(which also gives the generated token count per step); nothing in TRL is
changed.

Qwen-VL processors need torchvision in transformers 5.x (for the video
processor), and torchvision does not import beside the CPU torch here, so the
processor is built from Qwen's PIL image processor and the tokenizer with no
video processor (``_NoVideoQwen2_5_VLProcessor`` skips the class check of the
absent video processor only).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def make_processor(folder: str, family: str, min_pixels: int = 0, max_pixels: int = 0):
    """The processing class TRL gets: the tokenizer (text model) or a Qwen-VL processor without video (its images
    resized into [min_pixels, max_pixels] where given, as easytrain's data.min_pixels / data.max_pixels do)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    if family == "qwen2":
        return tokenizer
    from transformers import Qwen2_5_VLProcessor, Qwen2VLProcessor
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    base = Qwen2_5_VLProcessor if family == "qwen2_5_vl" else Qwen2VLProcessor

    class _NoVideoProcessor(base):  # type: ignore[misc, valid-type]
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument is None:  # no video processor: its class cannot be resolved without torchvision
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    _NoVideoProcessor.__name__ = f"_NoVideo{base.__name__}"
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(folder)
    if min_pixels and max_pixels:
        image_processor.size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    return _NoVideoProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                             chat_template=tokenizer.chat_template)


def make_dataset(family: str, size: int, seed: int, difficulty: int, task: str = "shapes/colour"):
    """easytrain's synthetic question (default: the colour one) as a TRL prompt dataset (conversational, image
    column for VL)."""
    import datasets
    import pyarrow.parquet as pq
    from PIL import Image

    from easytrain.data.synthetic import ensure_synthetic

    text_only = family == "qwen2"
    path = ensure_synthetic(task, "train", size, seed, difficulty, text_only=text_only)
    rows = pq.read_table(path).to_pylist()
    records = []
    for row in rows:
        # easytrain's prompt is "<image>question...": the image first, then the text (TRL puts images first too)
        text = row["problem"].replace("<image>", "")
        record = {"prompt": [{"role": "user", "content": text}], "answer": row["answer"]}
        if not text_only:
            record["image"] = Image.open(io.BytesIO(row["images"][0]["bytes"])).convert("RGB")
        records.append(record)
    return datasets.Dataset.from_list(records), str(path)


def answer_reward(completions, answer, **kwargs):
    """easytrain's built-in ``answer`` reward (exact final answer), in TRL's reward signature."""
    from easytrain.rewards.answers import answer_reward as easytrain_answer_reward

    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [s["overall"] for s in easytrain_answer_reward(texts, answer)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="tiny model folder (easytrain.models.tiny.build_tiny)")
    parser.add_argument("--family", choices=["qwen2_5_vl", "qwen2_vl", "qwen2"], required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--beta", type=float, default=0.04)
    parser.add_argument("--seed", type=int, default=1, help="trainer seed (easytrain's trainer.seed default)")
    parser.add_argument("--out", type=Path, required=True)
    # bench/gpu_step.py's settings (the defaults are trl_compare's CPU ones)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--bf16", action="store_true", help="bf16 weights and compute (model loaded in bf16)")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--task", default="shapes/colour", help="synthetic task (easytrain.data.synthetic)")
    parser.add_argument("--difficulty", type=int, default=0)
    parser.add_argument("--min-pixels", type=int, default=0)
    parser.add_argument("--max-pixels", type=int, default=0)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()

    started = time.perf_counter()
    import torch
    import transformers
    import trl
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    processor = make_processor(args.model, args.family, args.min_pixels, args.max_pixels)
    dataset, data_path = make_dataset(args.family, size=128, seed=args.seed, difficulty=args.difficulty,
                                      task=args.task)
    out_dir = tempfile.mkdtemp(prefix="easytrain-trl-bench-")
    batch = args.prompts * args.n
    config = GRPOConfig(
        output_dir=out_dir, max_steps=args.warmup + args.steps,
        per_device_train_batch_size=batch, gradient_accumulation_steps=1,  # one optimizer step = prompts x n
        num_generations=args.n, max_completion_length=args.new_tokens,
        temperature=1.0, top_p=1.0, top_k=0,
        beta=args.beta, loss_type="dapo", epsilon=0.2, epsilon_high=0.28, scale_rewards="group",
        learning_rate=args.lr, weight_decay=0.01, max_grad_norm=1.0, lr_scheduler_type="constant", warmup_steps=0,
        adam_beta1=0.9, adam_beta2=0.999,
        bf16=args.bf16, fp16=False, gradient_checkpointing=args.gradient_checkpointing,
        use_cpu=args.device == "cpu", use_vllm=False,
        model_init_kwargs={"dtype": torch.bfloat16 if args.bf16 else torch.float32},
        save_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=0, seed=args.seed,
        log_completions=False,
    )

    ends: list[float] = []
    begins: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            begins.append(time.perf_counter())

        def on_step_end(self, a, state, control, **kw):
            ends.append(time.perf_counter())

    trainer = GRPOTrainer(model=args.model, reward_funcs=answer_reward, args=config, train_dataset=dataset,
                          processing_class=processor, callbacks=[StepClock()])
    assert trainer.ref_model is not None, "beta > 0 must load a reference model"

    gen: list[tuple[float, int]] = []  # (seconds, generated tokens) per generation call
    inner = trainer._generate_single_turn

    def timed_generate(*a, **kw):
        t0 = time.perf_counter()
        completion_ids, logprobs = inner(*a, **kw)
        gen.append((time.perf_counter() - t0, sum(len(c) for c in completion_ids)))
        return completion_ids, logprobs

    trainer._generate_single_turn = timed_generate
    setup_s = time.perf_counter() - started
    train_start = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - train_start

    total = args.warmup + args.steps
    if len(ends) != total or len(gen) != total:
        raise SystemExit(f"expected {total} steps and generations, got {len(ends)} steps, {len(gen)} generations")
    cycle = [ends[0] - begins[0]] + [ends[i] - ends[i - 1] for i in range(1, total)]
    records = []
    for i in range(args.warmup, total):
        gen_s, tokens = gen[i]
        records.append({"step_s": cycle[i], "inner_step_s": ends[i] - begins[i], "generate_s": gen_s,
                        "generated_tokens": tokens, "tokens_per_s": tokens / cycle[i],
                        "generate_tokens_per_s": tokens / gen_s})
    median = statistics.median
    result = {
        "tool": "trl", "family": args.family, "model": args.model, "data": data_path,
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
                     "python": sys.version.split()[0]},
        "torch_threads": torch.get_num_threads(), "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
        "processes": 1,
        "processing_class": type(processor).__name__,
        "settings": {"per_device_train_batch_size": batch, "gradient_accumulation_steps": 1,
                     "num_generations": args.n, "max_completion_length": args.new_tokens, "beta": args.beta,
                     "temperature": 1.0, "loss_type": "dapo", "epsilon": 0.2, "epsilon_high": 0.28,
                     "learning_rate": args.lr, "bf16": args.bf16,
                     "gradient_checkpointing": args.gradient_checkpointing, "use_vllm": False,
                     "device": args.device, "task": args.task, "difficulty": args.difficulty,
                     "min_pixels": args.min_pixels, "max_pixels": args.max_pixels,
                     "warmup_steps_discarded": args.warmup, "measured_steps": args.steps,
                     "logging_steps": config.logging_steps},
        "setup_s": round(setup_s, 2), "train_s": round(train_s, 2),
        "median_step_s": median(r["step_s"] for r in records),
        "median_inner_step_s": median(r["inner_step_s"] for r in records),
        "median_generate_s": median(r["generate_s"] for r in records),
        "median_tokens_per_s": median(r["tokens_per_s"] for r in records),
        "median_generate_tokens_per_s": median(r["generate_tokens_per_s"] for r in records),
        "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
        "gpu_peak_gb": (round(torch.cuda.max_memory_allocated() / 2**30, 3) if args.device == "cuda" else None),
        "steps": records,
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"trl {args.family}: median step {result['median_step_s']:.3f} s, "
          f"{result['median_tokens_per_s']:.0f} generated tokens/s; threads {result['torch_threads']}")


if __name__ == "__main__":
    main()
