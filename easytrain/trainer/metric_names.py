"""Every metric name a run logs (``metrics.jsonl``, TensorBoard, W&B, MLflow, Ray gauges), with its meaning.

:data:`METRICS` maps a name, or a pattern for names built at run time (``<placeholder>`` parts, see
:data:`PLACEHOLDERS`), to one line saying what it measures. ``scripts/gen_docs.py`` writes
:func:`markdown` to ``docs/metrics.md``. ``tests/test_docs_generated.py`` keeps it true both ways: it scans
the package for the names the code logs (each must be here) and checks that each entry here is still logged
somewhere; ``tests/test_report_run.py`` checks the default run's ``metrics.jsonl`` against it.
"""

from __future__ import annotations

import re
from functools import lru_cache

__all__ = ["METRICS", "PLACEHOLDERS", "PREFIXES", "is_known", "markdown", "pattern"]

PLACEHOLDERS: dict[str, tuple[str, str]] = {
    "<group>": ("worker|actor|ref|rollout",
                "the worker process group: `worker` (fused workers, `trainer.colocate=true`, the RL default), or "
                "`actor`, `ref`, `rollout` (a pool per role, `trainer.colocate=false`; SFT has `actor` only)"),
    "<component>": ("[A-Za-z0-9_]+",
                    "a key the reward function returns besides `overall` (the built-in ones: `accuracy` from "
                    "`answer` and `math`, `format` from `format` or with `reward.format_weight` > 0)"),
}
"""Placeholder -> (the regular expression of its values, what it stands for)."""

PREFIXES: dict[str, str] = {
    "reward": "RL: the step's rewards, over all `data.rollout_batch_size` x `worker.rollout.n` responses.",
    "response_length": "RL: the step's responses, in tokens.",
    "prompt_length": "RL: the step's prompts, in tokens.",
    "actor": "The actor's update. RL: the losses, shares and entropy are means per response token over the "
             "step's whole update (every optimizer step and `worker.actor.ppo_epochs` epoch, all ranks); SFT "
             "logs `actor/grad_norm` and `actor/lr` only.",
    "sampling": "RL with `algorithm.dynamic_sampling` only.",
    "rollout": "RL, when the actor recomputes old log-probs (`worker.actor.reuse_log_probs_on_policy=false`, or "
               "an update that is not exactly on-policy).",
    "sync": "RL: the weight sync from the actor to the rollout engines after the update.",
    "train": "SFT: the step's optimizer step.",
    "time": "Wall seconds of the phases of a step, measured by the driver.",
    "perf": "Throughput.",
    "memory": "Memory, per step. The planner's figures and each call's measured peaks go to `memory.jsonl`, "
              "not here ([memory.md](memory.md)).",
    "checkpoint": "One record per checkpoint, logged at the step it was published.",
    "val": "One record per validation (`trainer.val_freq`, `trainer.val_before_train`, the end of the run).",
}
"""Each name's first part -> what its names have in common (the order of docs/metrics.md)."""

METRICS: dict[str, str] = {
    # reward
    "reward/mean": "Mean `overall` reward (what the advantages are computed from).",
    "reward/std": "Standard deviation of `overall`.",
    "reward/max": "Highest `overall`.",
    "reward/min": "Lowest `overall`.",
    "reward/<component>": "Mean of one component of the reward, e.g. `reward/accuracy`.",
    "reward/error_rate": "Share of responses scored 0 because their reward worker raised, died or passed "
                         "`reward.timeout_s`.",
    # response_length, prompt_length
    "response_length/mean": "Mean response length.",
    "response_length/max": "Longest response.",
    "response_length/min": "Shortest response.",
    "response_length/clip_ratio": "Share of responses that reached `data.max_response_length` (cut off).",
    "prompt_length/mean": "Mean prompt length, image tokens included.",
    # actor
    "actor/pg_loss": "RL: the clipped policy-gradient loss per token.",
    "actor/kl_loss": "RL with `algorithm.use_kl_loss` and a reference: the KL estimate (`algorithm.kl_penalty`) "
                     "of the actor to the reference per token, before `actor/kl_coef` weighs it.",
    "actor/reward_kl": "RL with the KL in the reward (`algorithm.use_kl_loss=false`): the sampled responses' KL "
                       "estimate to the reference per response token.",
    "actor/kl_coef": "RL: the KL coefficient after this step (changes only with `algorithm.kl_type=adaptive`).",
    "actor/clipfrac": "RL: share of tokens whose probability ratio was clipped (`clip_ratio_low`/`_high`).",
    "actor/dual_clipfrac": "RL: share of tokens held by the dual clip (negative advantages, `clip_ratio_dual`).",
    "actor/ppo_kl": "RL: mean of log(old / new probability) per token: how far the update moved from the "
                    "policy that sampled (about 0 for an exactly on-policy update).",
    "actor/entropy": "RL: mean entropy of the actor's sampling distribution per response token.",
    "actor/update_micro": "The update's micro batch per device at this step: samples, or tokens when padding-free "
                          "(`worker.actor.micro_batch_size_per_device_for_update` / `max_token_len_per_device` "
                          "until the watchdog's relief halves it).",
    "actor/grad_norm": "Global gradient norm before clipping (`optim.max_grad_norm`); RL: the mean over the "
                       "step's optimizer steps.",
    "actor/lr": "Learning rate. RL: the rate the step's last optimizer step applied; SFT: read after the "
                "optimizer step, so the rate of the next step.",
    # sampling
    "sampling/rounds": "Generation rounds the step took to fill its batch with informative groups.",
    "sampling/informative_groups": "Prompts whose responses did not all score the same (at most "
                                   "`data.rollout_batch_size`).",
    # rollout
    "rollout/log_prob_diff_mean": "Mean absolute difference between the engine's sampling log-probs and the "
                                  "actor's recomputed ones, per response token: near 0 when the sync took effect.",
    "rollout/log_prob_diff_max": "Largest such difference.",
    "rollout/log_prob_at_diff_max": "The actor's log-prob of the token with the largest difference: whether "
                                    "that gap sits at a likely token or far in the sampled tail.",
    "rollout/staleness": "`trainer.rollout_mode=one_step_off`: updates between the weights that generated the "
                         "step's batch and the actor's before its update (0 on the first step, then 1); with "
                         "one optimizer step per batch, `actor/ppo_kl` is then the actor's log-prob gap to the engine. "
                         "`trainer.rollout_mode=async`: the same per token, its mean over the step's tokens.",
    "rollout/staleness_max": "`trainer.rollout_mode=async`: the most updates between a trained token's sampling "
                             "weights and the actor's before its update (`rollout/staleness` is their token mean).",
    "rollout/stale_dropped": "`trainer.rollout_mode=async`: groups dropped from the queue this step for waiting "
                             "past `algorithm.max_staleness`.",
    "rollout/queue_full_s": "`trainer.rollout_mode=async`: seconds since the last step the engine idled because "
                            "no new prompts could start: the queue of finished and running samples was full (its "
                            "bound, `trainer.async_queue_gb`, or the step batches `algorithm.max_staleness` allows "
                            "ahead: max_staleness - 1).",
    "rollout/queue_held": "`trainer.rollout_mode=async`: engine calls since the last step that started no new "
                          "prompts because the queue was full.",
    "rollout/queue_gb": "`trainer.rollout_mode=async`: host GB the queue held when the step took its batch "
                        "(before taking it).",
    "rollout/queue_peak_gb": "`trainer.rollout_mode=async`: the queue's largest host GB so far.",
    "rollout/queue_bound_gb": "`trainer.rollout_mode=async`: the queue's bound (`trainer.async_queue_gb`, or the "
                              "plan's room; halved by the watchdog's soft level).",
    "rollout/tool_calls": "`worker.rollout.multi_turn`: tool calls per response (mean over the step's responses).",
    "rollout/tool_errors": "`worker.rollout.multi_turn`: tool calls in the step that failed (raised, timed out, "
                           "unknown tool, malformed call or arguments); each gave its sample an error turn.",
    # sync
    "sync/seconds": "Seconds of the weight sync (the slowest rank's).",
    "sync/buckets": "Buckets the weights went in (`worker.rollout.sync_bucket_mb`).",
    "sync/model_mb": "MB of weights synced.",
    "sync/tensors": "Tensors loaded into the engine.",
    "sync/in_place": "Fused workers, one process holding the whole actor: tensors copied straight into the "
                     "engine's parameters.",
    "sync/gather_s": "Fused workers: seconds gathering full tensors from the actor's shards (rank 0).",
    "sync/load_s": "Fused workers: seconds loading them into the engine (rank 0).",
    "sync/put_s": "A pool per role: seconds the actor's rank 0 spent putting its parts in Ray's object store.",
    "sync/wait_s": "A pool per role: seconds the actor's rank 0 waited for the rollout ranks to load a bucket.",
    "sync/assembled_peak_mb": "A pool per role: the most MB a rollout rank held assembled at once.",
    # train
    "train/loss": "SFT: cross-entropy per trained (assistant) token of the step.",
    "train/trained_tokens": "SFT: tokens the loss was computed on.",
    "train/micro_batches_per_rank": "SFT: micro batches each rank ran (fixed size, or token budget with "
                                    "`worker.actor.padding_free`).",
    "train/padding_waste": "SFT: share of the token slots the forward passes processed that were padding.",
    # time
    "time/step": "The whole step (the driver's `train_step`).",
    "time/generate": "RL: generation (every round of it with dynamic sampling); one step off, only the first "
                     "step's (later batches generate during the step before theirs).",
    "time/generate_wait": "RL, one step off: waiting for the next step's batch after the update (the part of "
                          "its generation the step did not hide).",
    "time/reward": "RL: waiting for the reward workers' scores, after the reference pass they overlap (with "
                   "`algorithm.dynamic_sampling` before it: the scores pick the groups).",
    "time/sleep": "RL: the engine's sleep as a call of its own (where no reference pass starts it).",
    "time/ref": "RL: the reference's log-probs (a fused worker puts its engine to sleep as this begins).",
    "time/old_log_probs": "RL: the actor's log-probs of the rollout (about 0 when they are reused on-policy).",
    "time/advantages": "RL: advantages, computed by the driver.",
    "time/update": "RL: the actor's update.",
    "time/sync": "RL: the weight sync (the engine wakes first).",
    "time/watchdog": "The memory watchdog judging the step at its end (not part of `time/step`).",
    "time/data": "SFT: the next batch and its micro batches, in the driver.",
    "time/forward_backward": "SFT: forward and backward passes, from the first rank's start to the last "
                             "rank's end.",
    "time/optimizer": "SFT: the optimizer step, likewise.",
    # perf
    "perf/generate_tokens_per_s": "RL: response tokens generated per second of `time/generate` (steps that "
                                  "generate their own batch).",
    "perf/train_tokens_per_s": "SFT: tokens (prompt and response) trained per second of `time/step`.",
    "perf/update_tokens": "RL: tokens the update's forward and backward passes ran over (prompts and responses, "
                          "times `worker.actor.ppo_epochs`): with `time/update` and the parameter count, the update's "
                          "MFU (`easytrain/trainer/mfu.py`).",
    # memory
    "memory/<group>_rss_gb_max": "Largest resident set (GB) among the group's worker processes at the step's end.",
    "memory/<group>_peak_rss_gb_max": "Largest lifetime peak resident set (GB) among the group's processes.",
    "memory/<group>_gpu_peak_gb_max": "GPU runs: largest torch allocator peak (GB) among the group's processes.",
    "memory/<group>_sleep_freed_gb_max": "RL, `worker` or `rollout` group: the most GB an engine's last sleep "
                                         "freed (0 where engines do not sleep).",
    "memory/node_ram_fraction_max": "The watchdog: highest RAM fraction of a node (`watchdog.ram_scope`) in the "
                                    "step's samples, the number its `ram_*` thresholds judge.",
    "memory/gpu_fraction_max": "The watchdog: highest used / total memory of a GPU (NVML) in the step's samples.",
    "memory/gpu_held_fraction_max": "The watchdog: highest GPU fraction as the `vram_*` thresholds judge it: "
                                    "what easytrain's processes hold where they report their allocators, else "
                                    "NVML's used.",
    "memory/relief_freed_gb": "GB the watchdog's relief freed at this step boundary (soft pressure only).",
    # checkpoint
    "checkpoint/step": "The step the checkpoint holds.",
    "checkpoint/blocked_s": "Seconds the step loop was blocked by it (the save call, any wait, the commit).",
    "checkpoint/write_s": "Seconds the slowest rank took to write its shards.",
    "checkpoint/staged_gb": "`trainer.checkpoint_async`: GB of host memory the largest rank staged.",
    # val
    "val/reward/mean": "Mean `overall` reward over the validation set (`worker.rollout.val_override` sampling; "
                       "SFT: greedy answers scored by `reward.function`).",
    "val/reward/std": "Standard deviation of the validation rewards.",
    "val/reward/max": "Highest validation reward.",
    "val/reward/min": "Lowest validation reward.",
    "val/reward/<component>": "Mean of one component of the validation reward, e.g. `val/reward/accuracy`.",
    "val/reward/error_rate": "RL: share of validation responses scored 0 by a failed reward worker.",
    "val/loss": "SFT: cross-entropy per trained token over the validation set.",
    "val/time": "Seconds of the validation (RL: its generation and scoring).",
}
"""Name or pattern -> what it means. Grouped by :data:`PREFIXES`; ``<placeholders>`` from :data:`PLACEHOLDERS`."""


def pattern(name: str) -> re.Pattern[str]:
    """A catalog entry as a regular expression over metric names (placeholders matched by their values)."""
    parts = re.split(r"(<[a-z_ ]+>)", name)
    return re.compile("".join(f"(?:{PLACEHOLDERS[p][0]})" if p in PLACEHOLDERS else re.escape(p) for p in parts))


@lru_cache(maxsize=None)
def _patterns() -> tuple[re.Pattern[str], ...]:
    return tuple(pattern(name) for name in METRICS)


def is_known(name: str) -> bool:
    """Whether ``name`` is a catalog entry or a name one of its patterns stands for."""
    return name in METRICS or any(p.fullmatch(name) for p in _patterns())


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown() -> str:
    """The whole of ``docs/metrics.md``."""
    lines = [
        "# easytrain: Metrics",
        "",
        "<!-- Generated by scripts/gen_docs.py from easytrain/trainer/metric_names.py; do not edit by hand:",
        "     change the catalog, then run `.venv/bin/python scripts/gen_docs.py`. -->",
        "",
        "Every name a run logs, once per step unless its section says otherwise: in the run folder's",
        "`metrics.jsonl` (one JSON record per line, with `step`), TensorBoard, W&B and MLflow",
        "(`trainer.loggers`), and as Ray gauges `easytrain_<name>` with `/` turned into `_`. The console line",
        "shows a few of them. A name appears only in runs that produce it (a GPU, a reference, a layout).",
        "",
        "Placeholders in names:",
        "",
    ]
    lines += [f"- `{p}`: {_cell(what)}" for p, (_, what) in PLACEHOLDERS.items()]
    for prefix, about in PREFIXES.items():
        lines += ["", f"## {prefix}/", "", about, "", "| name | meaning |", "| --- | --- |"]
        lines += [f"| `{name}` | {_cell(meaning)} |" for name, meaning in METRICS.items()
                  if name.split("/", 1)[0] == prefix]
    return "\n".join(lines) + "\n"
