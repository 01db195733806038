"""Generation with transformers ``generate``: the engine on CPU, and a reference on any device."""

from __future__ import annotations

import logging
from typing import Any, Iterable

import torch

from easytrain.algorithms.losses import token_log_probs
from easytrain.workers.forward import suppressed_tokens
from easytrain.distributed.batch import Batch
from easytrain.models.image_dedup import dedupe_images
from easytrain.workers.rollout.decode import decode, text_positions
from easytrain.workers.rollout.engine import EngineSpec, RolloutEngine, SamplingParams, response_mask

logger = logging.getLogger(__name__)

GENERATE_INPUTS = ("input_ids", "attention_mask", "pixel_values", "image_grid_thw", "mm_token_type_ids")


class HFEngine(RolloutEngine):
    def __init__(self, model: Any, stop_ids: list[int], pad_id: int, device: torch.device,
                 share_prefill: bool = True, drop_finished: bool = True) -> None:
        self.model, self.eos_ids, self.pad_id, self.device = model.eval(), stop_ids, pad_id, device
        self.share_prefill = share_prefill
        """Prefill each prompt once for its n samples (worker.rollout.share_prefill)."""
        self.drop_finished = drop_finished
        """Decode with easytrain's loop, finished rows leaving the batch (worker.rollout.drop_finished)."""
        self.suppressed = suppressed_tokens(model.config)

    @classmethod
    def build(cls, config: Any, spec: EngineSpec) -> "HFEngine":
        from easytrain.models.hf import load_model

        model = load_model(config.model, spec.folder).to(spec.device)
        if config.model.dedupe_images:  # the prompts' n copies share their images: one prefill of each
            dedupe_images(model)
        rollout = config.worker.rollout
        return cls(model, spec.stop_ids, spec.pad_id, spec.device, rollout.share_prefill, rollout.drop_finished)

    @torch.no_grad()
    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        if self.drop_finished:
            return self._decode(prompts, params)
        expanded = prompts.repeat_interleave(params.n)
        inputs = {k: expanded[k].to(self.device) for k in GENERATE_INPUTS if k in expanded}
        # A VL model computes its 3-D positions in the prefill only from images; without any it would not skip
        # the left padding, so such batches prefill each row.
        vision_ok = "image_grid_thw" in inputs or "mm_token_type_ids" not in inputs
        if self.share_prefill and params.n > 1 and inputs["input_ids"].shape[1] > 1 and vision_ok:
            inputs = self._prefilled(prompts, params.n, inputs)
        sample = params.temperature > 0
        torch.manual_seed(params.seed)
        out = self.model.generate(
            **inputs, do_sample=sample, temperature=params.temperature if sample else None,
            top_p=params.top_p if sample else None, top_k=(params.top_k if params.top_k > 0 else 0) if sample else None,
            max_new_tokens=params.max_new_tokens, eos_token_id=self.eos_ids, pad_token_id=self.pad_id,
            suppress_tokens=self.suppressed or None,
            return_dict_in_generate=True, output_logits=True, use_cache=True)
        prompt_len = inputs["input_ids"].shape[1]
        responses = out.sequences[:, prompt_len:]
        logits = torch.stack(out.logits, dim=1)  # (B*n, R, V): raw logits of every generated position
        return self._finish(responses, token_log_probs(logits, responses, params.temperature, self.suppressed))

    def _decode(self, prompts: Batch, params: SamplingParams) -> Batch:
        share = self.share_prefill and params.n > 1
        source = prompts if share else prompts.repeat_interleave(params.n)
        once = {k: source[k].to(self.device) for k in GENERATE_INPUTS if k in source}
        responses, raw = decode(self.model, once, params.n if share else 1, params, self.eos_ids, self.pad_id,
                                self.suppressed)
        return self._finish(responses, raw)

    def _finish(self, responses: torch.Tensor, raw_log_probs: torch.Tensor) -> Batch:
        """Responses cut after their stop token (pad after it), the mask, and the masked log-probs, on CPU."""
        mask = response_mask(responses, self.eos_ids)
        responses = torch.where(mask.bool(), responses, torch.full_like(responses, self.pad_id))
        return Batch({"responses": responses.cpu(), "response_mask": mask.cpu(),
                      "rollout_log_probs": (raw_log_probs * mask).cpu()})

    def _prefilled(self, prompts: Batch, n: int, expanded: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Prefill every prompt but its last token once, then hand ``generate`` the cache repeated for the
        prompt's ``n`` rows: it feeds the last prompt token and samples from there, as it would have after
        its own prefill of each row (images and prompt tokens computed once instead of ``n`` times)."""
        from transformers import DynamicCache

        once = {k: prompts[k].to(self.device) for k in GENERATE_INPUTS if k in prompts}
        head = {k: v[:, :-1] if k in ("input_ids", "attention_mask", "mm_token_type_ids") else v
                for k, v in once.items()}
        if "mm_token_type_ids" not in head:  # text model: positions that skip the left padding, as generate's
            head["position_ids"] = text_positions(head["attention_mask"])
        cache = DynamicCache(config=self.model.config)
        inner: Any = getattr(self.model, "model", None)
        if inner is not None and hasattr(inner, "rope_deltas"):
            inner.rope_deltas = None  # computed afresh from this batch's images by the prefill
        self.model(**head, past_key_values=cache, use_cache=True, logits_to_keep=1)
        cache.batch_repeat_interleave(n)
        if inner is not None and getattr(inner, "rope_deltas", None) is not None:
            inner.rope_deltas = inner.rope_deltas.repeat_interleave(n, dim=0)
        return {"input_ids": expanded["input_ids"], "attention_mask": expanded["attention_mask"],
                "past_key_values": cache}

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        params = self.model.state_dict(keep_vars=True)  # tied weights appear under every name
        loaded = 0
        for name, tensor in weights:
            target = params.get(name)
            if target is None:
                raise KeyError(f"rollout model has no weight named {name!r}")
            target.copy_(tensor.to(target.device, target.dtype))
            loaded += 1
        return loaded
