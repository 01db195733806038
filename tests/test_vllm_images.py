"""Real vLLM (the CPU build) generating from images, per family whose adapter serves vLLM: the prompt vLLM expands
is the actor's token for token (one resize, easytrain's, on both sides), greedy tokens are the HF engine's, and
after a weight sync that changed every weight (vision tower and projector included) vLLM's prompt and response
log-probs are the actor's within 1e-5 in float32."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Iterator

import pytest
import ray
import torch

from easytrain.config import load
from easytrain.distributed.batch import Batch
from easytrain.trainer.data import RLData
from easytrain.workers.rollout.engine import SamplingParams
import turn_helpers

if importlib.util.find_spec("vllm") is None:  # imported where used: collecting without it is ~3 s faster
    pytest.skip("vllm is not installed", allow_module_level=True)
pytestmark = pytest.mark.slow
ray.cloudpickle.register_pickle_by_value(turn_helpers)  # the engine's actor cannot import the tests folder

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "internvl")
TOLERANCE = 1e-5
"""float32 on both sides; the two run the same math in different kernels (vLLM's fused ones, torch's sdpa), so
they agree to a few float32 ulps of the log-softmax, not bit for bit (measured: at most ~1e-6)."""


TOOLS = Path(__file__).resolve().parent / "assets" / "turn_tools.py"


def overrides(family: str, output_dir: str) -> list[str]:
    """A small image task on vLLM; where the family's adapter serves tool images, multi-turn rollouts on (the
    engine then takes a prompt's images and its tool turns')."""
    from easytrain.models.families import adapter_class

    turns = (["worker.rollout.multi_turn.enable=true", f"worker.rollout.multi_turn.tools=[{TOOLS}:paint]"]
             if "multi_turn_images" in adapter_class(family).features else [])
    return [*turns, f"trainer.output_dir={output_dir}", f"model.path=tiny:{family}", "model.dtype=float32",
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
        self.spec, self.tokenizer, self.config = spec, tokenizer, config

    def perturb(self, seed: int, tower: bool) -> int:
        """Change the HF model's weights as training would (``tower``: the vision tower's alone, else every
        weight); the number of tensors changed."""
        from easytrain.models.families import family_of

        path = family_of(self.hf.model).tower_path
        generator = torch.Generator().manual_seed(seed)
        changed = 0
        with torch.no_grad():
            for name, p in self.hf.model.named_parameters():
                if tower and f"{path}." not in name:
                    continue
                p.add_(torch.randn(p.shape, generator=generator) * 0.02 * (p.std() if p.numel() > 1 else 1.0))
                changed += 1
        return changed

    def sync(self) -> int:
        """Load every weight of the HF model into vLLM as a sync does; the number of tensors vLLM took."""
        from easytrain.workers.weight_sync import to_hf_names

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

    def actor_log_probs(self, prompts: Batch, sampled: Batch, n: int, temperature: float) -> torch.Tensor:
        """The actor's response log-probs (easytrain's forward) of ``prompts`` joined with their ``sampled``
        responses as a step joins them."""
        from easytrain.models.families import family_of
        from easytrain.workers.forward import response_log_probs
        from easytrain.workers.sequences import assemble

        batch = assemble(prompts, sampled, n, family_of(self.hf.model))
        with torch.no_grad():
            return response_log_probs(self.hf.model, batch, temperature, torch.device("cpu"))[0]

    def actor_prompt_log_probs(self, prompts: Batch) -> torch.Tensor:
        """The actor's log-softmax at every prompt token after the first column, (B, L - 1)."""
        from easytrain.models.families import family_of
        from easytrain.workers.forward import model_inputs

        inputs = model_inputs(prompts, torch.device("cpu"), family_of(self.hf.model))
        with torch.no_grad():
            logits = self.hf.model(**inputs, use_cache=False).logits.float()
        return torch.log_softmax(logits[:, :-1], -1).gather(-1, prompts["input_ids"][:, 1:, None])[..., 0]

    def multi_turn(self, prompts: Batch, params: SamplingParams, call: list[int], tools: list[str],
                   length: int) -> list[Batch]:
        """The same two-turn rollout on vLLM and on the HF engine, the tool's images processed as a rollout worker
        does (:func:`turn_helpers.two_turns`)."""
        from easytrain.models.families import family_of
        from easytrain.models.families.base import Bound
        from easytrain.models.hf import load_image_processor
        from easytrain.workers.rollout.multi_turn import ToolImages

        d, family = self.config.data, family_of(self.hf.model)
        processor = load_image_processor(self.config.model, str(self.spec.folder))
        family.bound_processor(processor, d.min_pixels, d.max_pixels)
        images = ToolImages(Bound.of(family, processor, self.tokenizer), d.min_pixels, d.max_pixels)
        return turn_helpers.two_turns([self.engine, self.hf], self.spec, self.tokenizer, prompts, params, call,
                                      tools, length, images)


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
    assert all(_the_actors_size(family["name"], image, grid) for image, grid in zip(images, grids.tolist()))
    expanded = ray.get(family["host"].prompt_log_probs.remote(prompts))
    for i, (ids, _) in enumerate(expanded):
        assert ids == prompts["input_ids"][i][prompts["attention_mask"][i].bool()].tolist()


def _the_actors_size(name: str, image: Any, grid: list[int]) -> bool:
    """Whether ``image`` has the size the actor's ``image_grid_thw`` row says: Qwen-VL's patch grid (16-px patches
    on Qwen3-VL, else 14); InternVL's tile count (the tiny model's 56-px tiles, and a thumbnail beside several)."""
    if name == "internvl":
        cells = (image.height // 56) * (image.width // 56)
        return image.height % 56 == image.width % 56 == 0 and grid[0] == cells + (cells > 1)
    patch = 16 if name == "qwen3_vl" else 14
    return (image.height, image.width) == (grid[1] * patch, grid[2] * patch)


def _prompt_gap(host: Any, prompts: Batch) -> float:
    """The largest difference between vLLM's prompt log-probs and the actor's (the HF model's)."""
    actor = ray.get(host.actor_prompt_log_probs.remote(prompts))
    gap = 0.0
    for i, (ids, vllm_lp) in enumerate(ray.get(host.prompt_log_probs.remote(prompts))):
        keep = prompts["attention_mask"][i].bool()
        ours = actor[i, : prompts["input_ids"].shape[1] - 1][keep[1:] & keep[:-1]]  # after a real token
        assert len(ours) == len(vllm_lp) == len(ids) - 1
        gap = max(gap, float((ours - torch.tensor(vllm_lp)).abs().max()))
    return gap


def test_vllm_with_images_is_the_actor_after_a_sync(family: dict[str, Any]) -> None:
    host, prompts = family["host"], family["prompts"]
    assert _prompt_gap(host, prompts) < TOLERANCE  # the same weights (vLLM loaded the folder's)
    assert ray.get(host.perturb.remote(1, True)) > 0  # the vision tower trained: vLLM's prompts now differ...
    assert _prompt_gap(host, prompts) > 100 * TOLERANCE
    assert ray.get(host.sync.remote()) > 0  # ...until the sync brings the tower over
    assert _prompt_gap(host, prompts) < TOLERANCE
    assert ray.get(host.perturb.remote(2, False)) > 0 and ray.get(host.sync.remote()) > 0  # every weight
    greedy, hf_greedy = ray.get(host.generate.remote(prompts, SamplingParams(1, 0.0, 1.0, -1, 6)))
    masked = greedy["responses"] * greedy["response_mask"].long()
    assert torch.equal(masked, hf_greedy["responses"] * hf_greedy["response_mask"].long())

    sampled, _ = ray.get(host.generate.remote(prompts, SamplingParams(2, 1.0, 1.0, -1, 6, seed=3)))
    actor = ray.get(host.actor_log_probs.remote(prompts, sampled, 2, 1.0))
    mask = sampled["response_mask"].bool()
    assert (actor - sampled["rollout_log_probs"]).abs()[mask].max() < TOLERANCE

    assert _prompt_gap(host, prompts) < TOLERANCE


def test_a_conversation_with_tool_images_continues_on_vllm_as_on_hf(family: dict[str, Any]) -> None:
    """After a tool turn that returns an image, vLLM continues the conversation from its token ids (the tool
    image's pads expanded) with the prompt's image and the tool's: greedy, the HF engine's tokens."""
    from easytrain.models.families import adapter_class
    from easytrain.models.hf import load_tokenizer, model_folder

    if "multi_turn_images" not in adapter_class(family["name"]).features:  # (Qwen3-VL: a config error instead)
        pytest.skip(f"{family['name']}'s adapter does not serve tool images")
    config, prompts = family["config"], family["prompts"]
    tokenizer = load_tokenizer(config.model, model_folder(config.model))
    call = tokenizer('<tool_call>{"name":"paint","arguments":{"colour":"red"}}</tool_call>',
                     add_special_tokens=False)["input_ids"]
    length = 96
    vllm_out, hf_out = ray.get(family["host"].multi_turn.remote(prompts, SamplingParams(1, 0.0, 1.0, -1, length),
                                                              call, [f"{TOOLS}:paint"], length))
    assert vllm_out["tool_calls"].tolist() == [1.0] * len(prompts) and not vllm_out["tool_errors"].any()
    assert vllm_out.image_counts.tolist() == [2] * len(prompts)  # the prompt's image and the tool's
    trained, held = vllm_out["response_mask"].bool(), vllm_out["response_attention_mask"].bool()
    assert (trained & ((~trained & held).long().cumsum(-1) > 0)).any(-1).all()  # generated after the tool turn
    assert torch.equal(vllm_out["responses"] * vllm_out["response_attention_mask"].long(),
                       hf_out["responses"] * hf_out["response_attention_mask"].long())
    assert torch.equal(vllm_out["response_mask"], hf_out["response_mask"])
