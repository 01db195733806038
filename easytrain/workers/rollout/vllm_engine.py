"""Generation with vLLM, behind the rollout engine interface.

One in-process engine per rollout worker (``VLLM_ENABLE_V1_MULTIPROCESSING=0``):
the worker's Ray actor is the engine's process. In a fused worker (the actor
and the engine in one process per device) the engine joins the process's
torch.distributed world through vLLM's external launcher, each rank one
engine (a tensor-parallel engine spans consecutive ranks), and on CPU it
leaves the threads alone (``VLLM_CPU_OMP_THREADS_BIND=nobind``): its default
binding pins the process's OpenMP threads and turns ``torch.set_num_threads``
into a no-op, which would starve the actor's passes in the same process. Requests are the very token ids the
actor scores; a prompt with images also carries its images, PIL, as easytrain
sized them (one resize, shared by both sides), with each image's run of
placeholders handed back as one for vLLM's processor to expand again to the
same count (bounded by the same ``data.min_pixels``/``max_pixels``, so it
resizes nothing).

Log-probs: ``logprobs_mode="processed_logprobs"`` makes vLLM report log-probs
after its logits processors and temperature, with the vision placeholders
pushed out by ``logit_bias`` (vLLM's floor, -100: a probability below 1e-43 of
the top token's, nothing a float32 log-softmax can tell from the actor's -inf;
``allowed_token_ids`` would have to list every other id of the vocabulary,
~152k for a 7B vision-language model, and vLLM's GPU model runner takes at most 1024): the actor's convention
(:func:`easytrain.algorithms.losses.sampling_logits`) exactly when top-p and
top-k are off. With them on, vLLM reports the truncated distribution it
sampled from. The update never uses these values as old log-probs (it either
recomputes them or, on-policy, takes the detached current ones); a KL term in
the reward uses the actor's old log-probs when they are computed, and
validation refuses top-p/top-k with vLLM when it would have to use these.

Weights are loaded in place with vLLM's layer-wise reload (the machinery
behind its ``reload_weights``), one bucket at a time: a layer is repacked for
its kernels once all its tensors have arrived, whatever bucket they came in.

Sleep mode (GPU, colocated roles) frees weights and KV cache between
rollouts; on CPU vLLM refuses it, so sleep/wake are no-ops that say so once.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Iterable, Optional, Sequence

import torch

from easytrain.distributed.batch import Batch
from easytrain.models.families import Family, family_of
from easytrain.models.random_init import is_random_folder
from easytrain.workers.forward import suppressed_tokens
from easytrain.workers.rollout.engine import EngineSpec, RolloutEngine, SamplingParams, describe_sleep, pad_responses

logger = logging.getLogger(__name__)

BAN_BIAS = -100.0
"""The lowest logit bias vLLM applies (it clamps to [-100, 100])."""

INSTALL_HINT = ("vLLM is not installed: install the extra for your machine "
                "(bash scripts/install.sh cpu  or  bash scripts/install.sh gpu; i.e. pip install -e .[cpu] / .[gpu]) "
                "or set worker.rollout.engine=hf")


def engine_environment(cache_dir: Optional[str], on_cpu: bool, fused: bool = False) -> dict[str, str]:
    """Environment an in-process vLLM engine needs, set before vLLM reads it (values already set win)."""
    from easytrain.models.tiny import default_cache_dir

    cache = os.path.expanduser(cache_dir) if cache_dir else str(default_cache_dir())
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           # the first sampling call with log-probs compiles kernels; keep them across runs
           "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor")}
    if on_cpu:
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB of KV cache per engine
        if fused:  # the actor's torch threads share this process: no pinning
            env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    env["VLLM_LOGGING_LEVEL"] = "WARNING"  # vLLM's per-request INFO lines drown the run's own log
    return {k: os.environ.get(k, v) for k, v in env.items()}


def engine_kwargs(config: Any, spec: EngineSpec, family: Optional[Family] = None) -> dict[str, Any]:
    """Arguments of ``vllm.LLM`` from the composed config; ``family``: the model's adapter where prompts carry
    images (its processor settings keep vLLM's resizing in step with the data pipeline's)."""
    r, d, on_gpu = config.worker.rollout, config.data, spec.device.type == "cuda"
    kwargs: dict[str, Any] = dict(
        model=str(spec.folder), tokenizer=str(spec.folder), dtype=config.model.dtype,
        seed=config.trainer.seed + spec.member, tensor_parallel_size=r.tensor_parallel_size,
        max_model_len=r.max_model_len or d.max_prompt_length + d.max_response_length,
        max_num_batched_tokens=r.max_num_batched_tokens, max_num_seqs=r.max_num_seqs,
        enforce_eager=r.enforce_eager or not on_gpu, logprobs_mode="processed_logprobs",
        enable_prefix_caching=True,  # a prompt's n samples share its prefill
    )
    if on_gpu:
        kwargs["gpu_memory_utilization"] = r.gpu_memory_utilization
        kwargs["enable_sleep_mode"] = config.trainer.colocate and r.sleep_level > 0
    if is_random_folder(spec.folder):  # a random: model has no weights to read; the actor's arrive by sync
        kwargs["load_format"] = "dummy"
    if r.tensor_parallel_size > 1 or spec.fused:  # one engine per rank of a torch world
        kwargs["distributed_executor_backend"] = "external_launcher"
    if family is not None:
        tools = r.multi_turn.max_tool_images if r.multi_turn.enable else 0  # a conversation's tool images too
        kwargs["limit_mm_per_prompt"] = {"image": d.limit_images + tools}
        kwargs["mm_processor_kwargs"] = family.vllm_processor_kwargs(d.min_pixels, d.max_pixels)
    return kwargs


# Run inside vLLM's worker through collective_rpc (first argument: the vLLM worker).

def _model(worker: Any) -> Any:
    return worker.model_runner.get_model()


def _begin_reload(worker: Any) -> None:
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    initialize_layerwise_reload(_model(worker))


def _load(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> int:
    return len(_model(worker).load_weights(weights))


def _finish_reload(worker: Any) -> None:
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    runner = worker.model_runner
    finalize_layerwise_reload(_model(worker), runner.model_config)
    if hasattr(runner, "reset_lora_state"):
        runner.reset_lora_state()


WEIGHTLESS = ("RotaryEmbedding", "MRotaryEmbedding", "FusedMMInputNorm")
"""vLLM layers with nothing to load: rotary embeddings (their cos/sin caches are computed) and the vision
input's normalisation (its mean and std come from the processor's config)."""


class _QuietWeightless(logging.Filter):
    """Each reload warns that the :data:`WEIGHTLESS` layers got no weights; they have none to get, so those lines
    are dropped. Other layers still warn, except in a ``partial`` reload, where the frozen layers get none by
    design (vLLM keeps their weights)."""

    partial = False

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if self.partial and message.endswith(": Failed to load weights"):
            return False
        return not any(message.startswith(f"{layer}: Failed to load weights") for layer in WEIGHTLESS)


def ban(tokens: Iterable[int], vocab_size: int) -> Optional[dict[int, float]]:
    """``SamplingParams.logit_bias`` that keeps ``tokens`` out of every response (None when there are none)."""
    return {int(t): BAN_BIAS for t in tokens if 0 <= int(t) < vocab_size} or None


class VLLMEngine(RolloutEngine):
    def __init__(self, llm: Any, spec: EngineSpec, suppressed: list[int], vocab_size: int,
                 sleep_level: int, family: Optional[Family] = None) -> None:
        self.llm, self.spec, self.device = llm, spec, spec.device
        self.family = family
        """The model's adapter where prompts carry images (None: a text engine)."""
        self.banned = ban(suppressed, vocab_size)
        """The vision placeholders a response may never contain, as a logit bias at vLLM's floor."""
        self.sleep_level = sleep_level
        self.asleep: set[str] = set()
        self.stale = False
        """Level-2 sleep discarded the weights and no sync has refilled them yet."""
        self.quiet = _QuietWeightless()
        """Drops vLLM's reload warnings for layers that get no weights by design."""

    @classmethod
    def build(cls, config: Any, spec: EngineSpec) -> "VLLMEngine":
        from transformers import AutoConfig

        os.environ.update(engine_environment(config.model.cache_dir, spec.device.type != "cuda",
                                             fused=spec.fused))
        try:
            from vllm import LLM
        except ImportError as err:
            raise RuntimeError(INSTALL_HINT) from err
        hf_config = AutoConfig.from_pretrained(spec.folder)
        turns = config.worker.rollout.multi_turn
        images = config.data.image_key is not None or (turns.enable and turns.max_tool_images > 0)  # or tools'
        vision = getattr(hf_config, "vision_config", None) is not None and images
        text = getattr(hf_config, "text_config", hf_config)
        family = family_of(hf_config) if vision else None
        llm = LLM(**engine_kwargs(config, spec, family))
        sleeps = spec.device.type == "cuda" and config.trainer.colocate
        if not sleeps or config.worker.rollout.sleep_level == 0:
            logger.info("vLLM sleep mode is off here (it needs a GPU, colocated roles and "
                        "worker.rollout.sleep_level > 0): the engine keeps its weights and KV cache between "
                        "rollouts, and sleep/wake do nothing")
        engine = cls(llm, spec, suppressed_tokens(hf_config), int(text.vocab_size),
                     config.worker.rollout.sleep_level if sleeps else 0, family)
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(engine.quiet)
        return engine

    @property
    def can_sleep(self) -> bool:
        return self.sleep_level > 0

    # ------------------------------------------------------------------ generation

    def requests(self, prompts: Batch) -> list[dict[str, Any]]:
        """One vLLM prompt per row: the actor's own token ids (no second tokenisation); a row with images also
        gets its images, PIL, as easytrain sized them, with each image's placeholder given back to vLLM to
        expand (the family's :meth:`~easytrain.models.families.Family.vllm_prompt_ids`): vLLM's prompt is then
        the actor's token for token, as tests/test_vllm_images.py checks."""
        images = prompts.meta.get("images")
        out = []
        for i in range(len(prompts)):
            ids = prompts["input_ids"][i][prompts["attention_mask"][i].bool()].tolist()
            if images and images[i]:
                assert self.family is not None, "a prompt with images reached an engine built for text"
                out.append({"prompt_token_ids": self.family.vllm_prompt_ids(ids),
                            "multi_modal_data": {"image": list(images[i])}})
            else:
                out.append({"prompt_token_ids": ids})
        return out

    def sampling_params(self, params: SamplingParams, prompt_index: int) -> Any:
        from vllm import SamplingParams as VLLMSampling

        return VLLMSampling(
            n=params.n, temperature=params.temperature, top_p=params.top_p, top_k=max(params.top_k, 0),
            max_tokens=params.max_new_tokens, stop_token_ids=list(self.spec.stop_ids), logprobs=0,
            # vLLM seeds a request's j-th sample with seed + j: space prompts n apart so no two samples share one
            seed=params.seed + prompt_index * params.n, logit_bias=self.banned, detokenize=False)

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        if self.asleep or self.stale:
            raise RuntimeError(f"the vLLM engine cannot generate: {describe_sleep(self)}")
        requests = self.requests(prompts)
        outputs = self.llm.generate(requests, [self.sampling_params(params, i) for i in range(len(requests))],
                                    use_tqdm=False)
        rows: list[list[int]] = []
        log_probs: list[list[float]] = []
        for output in outputs:
            for completion in sorted(output.outputs, key=lambda c: c.index):
                tokens = list(completion.token_ids)
                rows.append(tokens)
                log_probs.append([entry[t].logprob for t, entry in zip(tokens, completion.logprobs or [])])
        return pad_responses(rows, log_probs, self.spec.pad_id, self.spec.stop_ids)

    # ------------------------------------------------------------------ weights

    def begin_weight_update(self, partial: bool = False) -> None:
        if "weights" in self.asleep:
            raise RuntimeError(f"the vLLM engine cannot take weights: {describe_sleep(self)}")
        self.quiet.partial = partial  # the frozen layers keep their weights: their "failed to load" lines go
        self.llm.collective_rpc(_begin_reload)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        bucket = list(weights)
        loaded = self.llm.collective_rpc(_load, args=(bucket,))
        return int(loaded[0])

    def finish_weight_update(self) -> None:
        self.llm.collective_rpc(_finish_reload)
        self.stale, self.synced, self.quiet.partial = False, True, False
        # everything cached was computed with the old weights: prefixes' KV, image embeddings (the engine
        # resets the scheduler's encoder-cache bookkeeping and the workers' caches together)
        self.llm.reset_prefix_cache()
        self.llm.llm_engine.reset_encoder_cache()
        self.llm.reset_mm_cache()

    # ------------------------------------------------------------------ memory

    def sleep(self) -> int:
        if self.sleep_level == 0 or "weights" in self.asleep:  # (level 0 was said once when the engine was built)
            return 0
        free_before = torch.cuda.mem_get_info()[0]
        self.llm.sleep(level=self.sleep_level)
        self.asleep = {"weights", "kv_cache"}
        self.stale = self.sleep_level == 2
        freed = max(0, torch.cuda.mem_get_info()[0] - free_before)
        logger.info("vLLM engine asleep (level %d): %.2f GB of GPU memory freed", self.sleep_level, freed / 1e9)
        return freed

    def wake(self, tags: Sequence[str] = ("weights", "kv_cache")) -> None:
        todo = [t for t in tags if t in self.asleep]
        if not todo:
            return
        self.llm.wake_up(tags=todo)
        self.asleep -= set(todo)
