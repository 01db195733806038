"""Real vLLM (the CPU build) generating from images, per family whose model vLLM serves: the prompt vLLM expands
is the actor's token for token (one resize, easytrain's, on both sides), greedy tokens are the HF engine's, and
after a weight sync that changed every weight (vision tower and projector included) vLLM's prompt and response
log-probs are the actor's within 1e-5 in float32."""

from __future__ import annotations

from typing import Any, Iterator

import pytest
import ray
import torch

from easytrain.config import load
from easytrain.distributed.batch import Batch
from easytrain.trainer.data import RLData
from easytrain.workers.rollout.engine import SamplingParams
from easytrain.workers.sequences import assemble

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
TOLERANCE = 1e-5
"""float32 on both sides; the two run the same math in different kernels (vLLM's fused ones, torch's sdpa), so
they agree to a few float32 ulps of the log-softmax, not bit for bit (measured: at most ~1e-6)."""


def overrides(family: str, output_dir: str) -> list[str]:
    return [f"trainer.output_dir={output_dir}", f"model.path=tiny:{family}", "model.dtype=float32",
            "worker.rollout.engine=vllm", "trainer.device=cpu", "data.synthetic_size=8", "data.synthetic_val_size=4",
            "data.rollout_batch_size=4", "worker.actor.global_batch_size=4", "worker.rollout.n=2",
            "data.max_response_length=6", "data.num_workers=0", "trainer.workers_per_node=1"]


@ray.remote(num_cpus=0)
class VisionHost:
    """A vLLM engine and the HF model of the same folder in one process (never the test process: vLLM pins its
    threads)."""

    def __init__(self, config: Any) -> None:
        from easytrain.models.hf import load_tokenizer, model_folder
        from easytrain.workers.rollout.engine import EngineSpec
        from easytrain.workers.rollout.hf_engine import HFEngine
        from easytrain.workers.rollout.vllm_engine import VLLMEngine
        from easytrain.workers.rollout.worker import stop_token_ids

        folder = model_folder(config.model)
        tokenizer = load_tokenizer(config.model, folder)
        spec = EngineSpec(folder, stop_token_ids(tokenizer, []), tokenizer.pad_token_id, torch.device("cpu"))
        self.engine = VLLMEngine.build(config, spec)
        self.hf = HFEngine.build(config, spec)
        self.hf.model.eval()

    def perturb_and_sync(self, seed: int) -> int:
        """Change every weight of the HF model (a trained actor's), then load all of them into vLLM as a sync does;
        the number of tensors vLLM took."""
        from easytrain.workers.weight_sync import to_hf_names

        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.hf.model.parameters():
                p.add_(torch.randn(p.shape, generator=generator) * 0.02 * (p.std() if p.numel() > 1 else 1.0))
        self.engine.begin_weight_update()
        loaded = self.engine.load_weights(to_hf_names(dict(self.hf.model.state_dict())).items())
        self.engine.finish_weight_update()
        return loaded

    def generate(self, prompts: Batch, params: SamplingParams) -> tuple[Batch, Batch]:
        """The same prompts on vLLM and on the HF engine."""
        return self.engine.generate(prompts, params), self.hf.generate(prompts, params)

    def prompt_log_probs(self, prompts: Batch) -> list[tuple[list[int], list[float]]]:
        """vLLM's prompt as it expanded it (token ids) and each token's log-prob after the first."""
        from vllm import SamplingParams as VLLMSampling

        outputs = self.engine.llm.generate(self.engine.requests(prompts),
                                           VLLMSampling(max_tokens=1, prompt_logprobs=0, detokenize=False),
                                           use_tqdm=False)
        return [(list(o.prompt_token_ids), [entry[t].logprob for t, entry in zip(o.prompt_token_ids[1:],
                                                                                   o.prompt_logprobs[1:])])
                for o in outputs]

    def actor_log_probs(self, prompts: Batch, sampled: Batch, n: int,
                        temperature: float) -> tuple[Batch, torch.Tensor, torch.Tensor]:
        """``prompts`` joined with their ``sampled`` responses as a step does, the actor's response log-probs of
        them (easytrain's forward) and its log-softmax at every token of the joined rows."""
        from easytrain.models.families import family_of
        from easytrain.workers.forward import model_inputs, response_log_probs

        batch = assemble(prompts, sampled, n, family_of(self.hf.model))
        with torch.no_grad():
            responses, _ = response_log_probs(self.hf.model, batch, temperature, torch.device("cpu"))
            inputs = model_inputs(batch, torch.device("cpu"), family_of(self.hf.model))
            logits = self.hf.model(**inputs, use_cache=False).logits.float()
        ids = batch["input_ids"]
        full = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
        return batch, responses, full


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, ray_clusters: Any,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    ray_clusters.local()
    config = load(overrides(request.param, str(tmp_path_factory.mktemp(request.param))))
    prompts = next(RLData(config).train_batches())
    host = VisionHost.remote(config)
    yield {"name": request.param, "config": config, "prompts": prompts, "host": host}
    ray.kill(host)


def test_vllm_expands_the_actors_prompt_and_sees_the_actors_pixels(family: dict[str, Any]) -> None:
    """One resize, easytrain's: each image vLLM is given has the size of the actor's grid, and vLLM's expanded
    prompt is the actor's token ids (its processor resized nothing: another size would give other counts of
    image pads)."""
    prompts = family["prompts"]
    grids = prompts.expanded_tensors()["image_grid_thw"]
    images = [image for row in prompts.meta["images"] for image in row]
    assert len(images) == len(grids) > 0
    patch = 16 if family["name"] == "qwen3_vl" else 14
    for image, (_, h, w) in zip(images, grids.tolist()):
        assert (image.height, image.width) == (h * patch, w * patch)
    expanded = ray.get(family["host"].prompt_log_probs.remote(prompts))
    for i, (ids, _) in enumerate(expanded):
        assert ids == prompts["input_ids"][i][prompts["attention_mask"][i].bool()].tolist()


def test_vllm_with_images_is_the_actor_after_a_sync(family: dict[str, Any]) -> None:
    host, prompts = family["host"], family["prompts"]
    assert ray.get(host.perturb_and_sync.remote(1)) > 0
    greedy, hf_greedy = ray.get(host.generate.remote(prompts, SamplingParams(1, 0.0, 1.0, -1, 6)))
    masked = greedy["responses"] * greedy["response_mask"].long()
    assert torch.equal(masked, hf_greedy["responses"] * hf_greedy["response_mask"].long())

    sampled, _ = ray.get(host.generate.remote(prompts, SamplingParams(2, 1.0, 1.0, -1, 6, seed=3)))
    batch, actor, prompt_actor = ray.get(host.actor_log_probs.remote(prompts, sampled, 2, 1.0))
    mask = sampled["response_mask"].bool()
    assert (actor - sampled["rollout_log_probs"]).abs()[mask].max() < TOLERANCE

    expanded = ray.get(host.prompt_log_probs.remote(prompts))
    for i, (ids, vllm_lp) in enumerate(expanded):
        row = 2 * i  # the batch repeats each prompt n=2 times; its prompt columns are the prompt's
        keep = batch["attention_mask"][row, : prompts["input_ids"].shape[1]].bool()
        ours = prompt_actor[row, : prompts["input_ids"].shape[1] - 1][keep[1:] & keep[:-1]]  # after a real token
        assert len(ours) == len(vllm_lp) == len(ids) - 1
        assert (ours - torch.tensor(vllm_lp)).abs().max() < TOLERANCE
