"""Generation with transformers ``generate``: the engine on CPU, and a reference on any device.

In a fused worker the engine sleeps while the other roles compute: level 2 drops its weights (the next sync
refills them in place; on CPU this frees the engine's host copy for the training phases), level 1 moves them
to host memory (on a GPU; on CPU they are already there, so level 1 frees nothing and the engine stays awake).
Its dynamic decode loop holds no KV cache between generations; the static one (CUDA) keeps its cache for
the next generation of the same shape until the engine sleeps.

Its decode loop reads the node's pressure flag (:mod:`easytrain.memory.flag`) at every token: at the hard
level the generation stops (:class:`MemoryStop`: the step ends unfinished, nothing of it trained); at the soft
level the prompts still to generate are taken in pieces half the size, each with its own KV cache, the piece
in flight is begun again, and the engine keeps the smaller piece for the rest of the run.

One decode path per device class: on CUDA (``worker.rollout.static_cache=auto``) the static-cache loop, whose
steps replay as CUDA graphs (:mod:`easytrain.workers.rollout.static_decode`); elsewhere easytrain's loop, in
which each prompt is prefilled once for its n samples and finished rows leave the batch
(:mod:`easytrain.workers.rollout.decode`). Both go through the same pieces and pressure checks. A family whose
adapter does not serve ``kv_reuse`` (the generic one: its KV cache may not take row copies and selections)
decodes with transformers ``generate``, every row until the longest ends.
"""

from __future__ import annotations

import gc
import logging
from functools import partial
from typing import Any, Iterable, Optional, Sequence

import torch

from easytrain.algorithms.losses import token_log_probs
from easytrain.data.vision import VISUAL_KEYS
from easytrain.workers.forward import model_inputs, suppressed_tokens, takes_video_seconds
from easytrain.distributed.batch import Batch
from easytrain.memory.flag import MemoryStop, PressureFlag
from easytrain.models.families import family_of
from easytrain.workers.rollout.decode import decode
from easytrain.workers.rollout.engine import EngineSpec, RolloutEngine, SamplingParams, describe_sleep, response_mask
from easytrain.workers.rollout.static_decode import StaticDecoder, unsupported, wants_static
from easytrain.workers.sequences import continued_positions

logger = logging.getLogger(__name__)

GENERATE_INPUTS = ("input_ids", "attention_mask", *VISUAL_KEYS, "mm_token_type_ids")


class _Shrink(Exception):
    """Soft pressure seen while a piece decodes: begin it again in smaller pieces."""


class HFEngine(RolloutEngine):
    def __init__(self, model: Any, stop_ids: list[int], pad_id: int, device: torch.device, sleep_level: int = 0,
                 static_cache: str = "auto") -> None:
        self.model, self.eos_ids, self.pad_id, self.device = model.eval(), stop_ids, pad_id, device
        reason = family_of(model).unsupported("kv_reuse")
        self.reuses_kv = reason is None
        """easytrain's decode loops serve the model (its family reuses KV cache rows); else ``generate``."""
        if not self.reuses_kv:
            logger.info("the HF engine decodes with transformers generate: %s", reason)
        self.static: Optional[StaticDecoder] = None
        """The static-cache loop (worker.rollout.static_cache), compiled on CUDA; None = the dynamic loop."""
        if self.reuses_kv and wants_static(static_cache, device):
            reason = unsupported(model)
            if reason is None or static_cache == "on":  # "on" with an unsupported model raises here
                self.static = StaticDecoder.for_device(model, device)
            else:
                logger.info("worker.rollout.static_cache=auto: no static KV cache, %s", reason)
        self.suppressed = suppressed_tokens(model.config)
        self.sleep_level = sleep_level if device.type == "cuda" or sleep_level == 2 else 0
        self.asleep: set[str] = set()
        self.stale = False
        """Level-2 sleep dropped the weights and no sync has refilled them yet."""
        self._shapes: dict[int, tuple[torch.Size, torch.dtype]] = {}
        self._filled: set[int] = set()
        self.pressure: Optional[PressureFlag] = None
        """The node's pressure flag, read at every decoded token (set by the rollout worker under a watchdog)."""
        self.piece: Optional[int] = None
        """Prompts generated together; None = all of a call's (soft pressure halves it, see :meth:`_decode`)."""
        self.shrunk = False
        """The piece was halved in this spell of soft pressure."""

    @classmethod
    def build(cls, config: Any, spec: EngineSpec) -> "HFEngine":
        from easytrain.models.hf import load_model

        model = load_model(config.model, str(spec.folder), device=str(spec.device))  # a random: model is built there
        if config.model.dedupe_images:  # the prompts' n copies share their images: one prefill of each
            family_of(model).dedupe_images(model)
        rollout = config.worker.rollout
        return cls(model, spec.stop_ids, spec.pad_id, spec.device, rollout.sleep_level if spec.fused else 0,
                   rollout.static_cache)

    # ------------------------------------------------------------------ sleep

    @property
    def can_sleep(self) -> bool:
        return self.sleep_level > 0

    def _parameters(self) -> list[torch.nn.Parameter]:
        return list({id(p): p for p in self.model.parameters()}.values())  # tied weights once

    def sleep(self) -> int:
        if not self.can_sleep or "weights" in self.asleep:
            return 0
        freed = 0
        for param in self._parameters():
            freed += param.numel() * param.element_size()
            if self.sleep_level == 2:
                self._shapes[id(param)] = (param.shape, param.dtype)
                param.data = torch.empty(0, dtype=param.dtype, device=self.device)
            else:
                param.data = param.data.to("cpu")
        if self.static is not None:
            self.static.release()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.asleep = {"weights", "kv_cache"}
        self.stale = self.sleep_level == 2
        return freed

    def wake(self, tags: Sequence[str] = ("weights", "kv_cache")) -> None:
        if "weights" in tags and "weights" in self.asleep:
            for param in self._parameters():
                if self.sleep_level == 2:  # room for the sync to fill
                    shape, dtype = self._shapes.pop(id(param))
                    param.data = torch.empty(shape, dtype=dtype, device=self.device)
                else:
                    param.data = param.data.to(self.device)
        self.asleep -= set(tags)

    @torch.no_grad()
    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        if self.asleep or self.stale:
            raise RuntimeError(f"the HF engine cannot generate: {describe_sleep(self)}")
        return self._decode(prompts, params) if self.reuses_kv else self.transformers_generate(prompts, params)

    def transformers_generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        """:meth:`generate` through transformers ``generate``, each row prefilled and decoded until the longest
        ends: the path of a family without KV reuse, and the reference the tests hold the decode loops to."""
        inputs = self._inputs(prompts.repeat_interleave(params.n))
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
        """Decode ``prompts`` in pieces of :attr:`piece` prompts (all at once by default). Piece ``k`` starting at
        prompt ``i`` samples with seed ``params.seed + i * n``: the whole batch in one piece draws what it always
        did. Soft pressure while a piece decodes halves the piece size and begins it again, once per spell of
        pressure (until the flag reads below soft at the start of a generation)."""
        share = params.n > 1  # each prompt prefilled once, its cache repeated for its n rows
        run = self.static.decode if self.static is not None else partial(decode, self.model)
        outputs: list[tuple[torch.Tensor, torch.Tensor]] = []
        start = 0
        if self.pressure is not None and self.pressure.read()[0] not in ("soft", "hard"):
            self.shrunk = False
        while start < len(prompts):
            size = min(self.piece or len(prompts), len(prompts) - start)
            piece = prompts.select(range(start, start + size)) if size < len(prompts) else prompts
            source = piece if share else piece.repeat_interleave(params.n)
            once = self._inputs(source)
            seeded = SamplingParams(params.n, params.temperature, params.top_p, params.top_k, params.max_new_tokens,
                                    params.seed + start * params.n)
            check = self._watch(can_shrink=size > 1 and not self.shrunk)
            try:
                outputs.append(run(once, params.n if share else 1, seeded, self.eos_ids, self.pad_id, self.suppressed,
                                   check))
            except _Shrink as soft:
                self.shrunk, self.piece = True, (size + 1) // 2
                if self.static is not None:
                    self.static.release()
                del once, source, piece
                gc.collect()  # the abandoned piece's KV cache goes now, before the smaller pieces decode
                logger.warning("memory: %s during generation; generating %d prompt(s) at a time from here on "
                               "(was %d)", soft, self.piece, size)
                continue
            except MemoryStop:
                raise
            except Exception as err:  # noqa: BLE001 - the compiled path is new on each GPU/torch pairing
                if self.static is None or self.device.type != "cuda":
                    raise
                logger.warning("worker.rollout.static_cache: the compiled static-cache decode failed (%s: %s); this "
                               "engine decodes with the dynamic loop from here on (set worker.rollout.static_cache="
                               "off to start that way)", type(err).__name__, str(err).splitlines()[0] if str(err)
                               else "")
                self.static.release()
                self.static, run = None, partial(decode, self.model)
                continue  # the same piece again, on the dynamic loop
            start += size
        width = max(r.shape[1] for r, _ in outputs)
        responses = torch.cat([torch.nn.functional.pad(r, (0, width - r.shape[1]), value=self.pad_id)
                               for r, _ in outputs])
        raw = torch.cat([torch.nn.functional.pad(lp, (0, width - lp.shape[1])) for _, lp in outputs])
        return self._finish(responses, raw)

    def _watch(self, can_shrink: bool) -> Optional[Any]:
        """What the decode loop calls at every token: raises at the hard level (:class:`MemoryStop`), and at the
        soft one when the piece can still be halved."""
        flag = self.pressure
        if flag is None:
            return None

        def check() -> None:
            lv, line = flag.read()
            if lv == "hard":
                raise MemoryStop(f"{line} (during generation)")
            if lv == "soft" and can_shrink:
                raise _Shrink(line)

        return check

    def _finish(self, responses: torch.Tensor, raw_log_probs: torch.Tensor) -> Batch:
        """Responses cut after their stop token (pad after it), the mask, and the masked log-probs, on CPU."""
        mask = response_mask(responses, self.eos_ids)
        responses = torch.where(mask.bool(), responses, torch.full_like(responses, self.pad_id))
        return Batch({"responses": responses.cpu(), "response_mask": mask.cpu(),
                      "rollout_log_probs": (raw_log_probs * mask).cpu()})

    def _inputs(self, batch: Batch) -> dict[str, torch.Tensor]:
        """What generation feeds the model from ``batch``, on this engine's device (videos split from images); a
        partial rollout's continuation (``continued``) with its positions (:func:`continued_positions`)."""
        family = family_of(self.model)
        inputs = model_inputs(batch, self.device, family, GENERATE_INPUTS, takes_video_seconds(self.model))
        if "continued" in batch and family.rope_rows and "mm_token_type_ids" in batch:
            inputs["position_ids"] = continued_positions(family, batch).to(self.device)
        return inputs

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        params = self.model.state_dict(keep_vars=True)  # tied weights appear under every name
        loaded = 0
        for name, tensor in weights:
            target = params.get(name)
            if target is None:
                raise KeyError(f"rollout model has no weight named {name!r}")
            target.copy_(tensor.to(target.device, target.dtype))
            self._filled.add(id(target))
            loaded += 1
        return loaded

    def in_place_targets(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """The parameters themselves (HF's tensors are plain and contiguous)."""
        params = self.model.state_dict(keep_vars=True)
        out: dict[str, torch.Tensor] = {}
        for name in names:
            param = params.get(name)
            if isinstance(param, torch.nn.Parameter) and param.data.is_contiguous():
                self._filled.add(id(param))
                out[name] = param.data
        return out

    def begin_weight_update(self, partial: bool = False) -> None:
        if "weights" in self.asleep:
            raise RuntimeError(f"the HF engine cannot take weights: {describe_sleep(self)}")
        self._filled = set()

    def finish_weight_update(self) -> None:
        if self.stale:  # every dropped weight must have been refilled
            missing = [name for name, p in self.model.named_parameters() if id(p) not in self._filled]
            if missing:
                raise RuntimeError(f"weight sync left {len(missing)} dropped weights unfilled (e.g. {missing[0]})")
        self.stale, self.synced = False, True
