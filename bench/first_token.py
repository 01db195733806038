"""Where the engine's and the actor's log-probs part, attention kernel by attention kernel (one process, no Ray).

    .venv/bin/python bench/first_token.py --device cpu       # or --device cuda; prints JSON, writes no file

The tiny random model (float32) is built on the device; one batch of prompts of the default synthetic image task
comes through easytrain's data pipeline (:class:`~easytrain.trainer.data.RLData`). For every decode path of the
real :class:`~easytrain.workers.rollout.hf_engine.HFEngine` (``static``: the static KV cache, compiled into CUDA
graphs on CUDA and eager elsewhere; ``dynamic``, easytrain's loop; ``generate``) and every attention (``sdpa`` left to
torch's choice, ``sdpa:<backend>`` pinned by ``torch.nn.attention.sdpa_kernel``, ``eager``) the engine decodes
greedily, ``n`` samples per prompt, and the actor's forward code (:func:`~easytrain.workers.forward.log_probs_of`)
recomputes the responses' log-probs in each layout (padded, padding-free, prompt-shared, both), under the same
attention. On CUDA with sdpa the actor's language model attends through easytrain's segments, as the workers set it.

Per run: ``first`` / ``all``: the largest |engine - actor| log-prob gap at the first response token / over all
response tokens; ``tokens_equal``: greedy tokens equal to the ``generate|eager`` run's; ``*_vs_alone``: the
first token's gap to a plain forward of each prompt alone, without padding (same kernel), for the engine and for
each actor layout. ``prefill`` per attention: the engine's prefill logits against that forward's. A combination
the device cannot run holds ``error``, one line. The static path recompiles for every attention on CUDA.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import tempfile
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from logging.handlers import BufferingHandler
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from easytrain.algorithms.losses import token_log_probs  # noqa: E402
from easytrain.config import load  # noqa: E402
from easytrain.distributed.batch import Batch, MicroBatch  # noqa: E402
from easytrain.models.families import Family  # noqa: E402
from easytrain.models.hf import load_model, model_folder  # noqa: E402
from easytrain.models.segments import apply_segment_attention  # noqa: E402
from easytrain.trainer.data import RLData  # noqa: E402
from easytrain.workers.forward import log_probs_of, suppressed_tokens  # noqa: E402
from easytrain.workers.rollout.decode import prefill  # noqa: E402
from easytrain.workers.rollout.engine import SamplingParams  # noqa: E402
from easytrain.workers.rollout.hf_engine import HFEngine  # noqa: E402
from easytrain.workers.rollout.worker import stop_token_ids  # noqa: E402
from easytrain.workers.sequences import assemble  # noqa: E402
from easytrain.workers.shared_prompt import prompt_groups, text_config  # noqa: E402

logger = logging.getLogger("first_token")

BACKENDS = {"math": SDPBackend.MATH, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
ATTENTIONS = ("sdpa", *(f"sdpa:{name}" for name in BACKENDS), "eager")
PATHS = ("static", "dynamic", "generate")
LAYOUTS = {"padded": (False, False), "packed": (True, False), "shared": (False, True), "packed_shared": (True, True)}
REFERENCE = "generate|eager"  # whose greedy tokens the others are compared with: transformers' own loop and attention


@dataclass
class Probe:
    """The model, the prompts and what the engine needs, built once."""

    model: Any
    prompts: Batch
    family: Family
    stops: list[int]
    pad: int
    params: SamplingParams
    temperature: float
    device: torch.device


def one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]


def guarded(work: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``work()``'s record, or its error in one line."""
    try:
        return work()
    except Exception as err:  # noqa: BLE001 - a kernel this device lacks is a finding, not a crash
        return {"error": one_line(err)}


@contextmanager
def attention(model: Any, kind: str) -> Iterator[None]:
    """``kind`` for every attention of the model (vision tower too): eager, or sdpa with its backend pinned."""
    model.set_attn_implementation("eager" if kind == "eager" else "sdpa")
    backend = BACKENDS.get(kind.partition(":")[2])
    with sdpa_kernel(backend) if backend is not None else nullcontext():
        yield


@contextmanager
def actor_attention(model: Any, kind: str, device: torch.device) -> Iterator[None]:
    """The actor's language model as ``build_sharded_model`` sets it: easytrain's segments on CUDA with sdpa."""
    if device.type != "cuda" or kind == "eager":
        yield
        return
    apply_segment_attention(model)
    try:
        yield
    finally:
        text_config(model)._attn_implementation = "sdpa"  # noqa: SLF001 - the engine's attention again


def build(device: torch.device, family: str, n: int, tmp: str) -> Probe:
    config = load([f"trainer.output_dir={tmp}", f"model.path=tiny:{family}", "model.dtype=float32",
                   "model.attn_implementation=sdpa", "data.num_workers=0", "data.synthetic_size=8",
                   "data.synthetic_val_size=4", "data.rollout_batch_size=4", "worker.actor.global_batch_size=4",
                   "data.max_response_length=8", f"worker.rollout.n={n}"])
    data = RLData(config)
    model = load_model(config.model, model_folder(config.model), device=str(device))
    tokenizer = data.tokenizer
    params = SamplingParams(n, 0.0, 1.0, 0, config.data.max_response_length, seed=0)
    stops = stop_token_ids(tokenizer, config.worker.rollout.stop_tokens)
    return Probe(model, next(data.train_batches()), data.family, stops, tokenizer.pad_token_id, params,
                 config.worker.rollout.temperature, device)


PER_TOKEN = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")
"""Model inputs with a column per token (cutting a prompt's padding cuts them)."""


def alone_logits(probe: Probe, engine: HFEngine) -> torch.Tensor:
    """Next-token logits (B, V) of each prompt run alone, its padding cut: a plain forward, no cache."""
    rows = []
    for i in range(len(probe.prompts)):
        inputs = engine._inputs(probe.prompts.select([i]))  # noqa: SLF001 - the engine's own model inputs
        keep = inputs["attention_mask"][0].bool()
        inputs = {k: v[:, keep] if k in PER_TOKEN else v for k, v in inputs.items()}
        probe.family.begin_prefill(probe.model)  # positions from this prompt's own images
        out = probe.model(**inputs, use_cache=False, logits_to_keep=1)
        rows.append(out.logits[:, -1].float())
    return torch.cat(rows)


def prefill_gap(probe: Probe, engine: HFEngine, alone: torch.Tensor) -> dict[str, Any]:
    _, logits, _ = prefill(probe.model, engine._inputs(probe.prompts))  # noqa: SLF001
    gap = (logits - alone).abs().amax(-1)
    return {"logits_gap": float(gap.max()), "rows": short(gap), "logit_scale": float(alone.abs().max()),
            "argmax_equal": bool(torch.equal(logits.argmax(-1), alone.argmax(-1)))}


def short(values: torch.Tensor) -> list[float]:
    return [float(f"{v:.3g}") for v in values.tolist()]


def gaps(ours: torch.Tensor, theirs: torch.Tensor, mask: torch.Tensor) -> dict[str, Any]:
    gap = (ours - theirs).abs() * mask
    return {"first": float(gap[:, 0].max()), "all": float(gap.max()), "first_rows": short(gap[:, 0])}


def actor(probe: Probe, batch: Batch, layout: str, alone_first: torch.Tensor) -> dict[str, Any]:
    packed, shared = LAYOUTS[layout]
    groups = prompt_groups(batch) if shared else None
    if groups is not None and all(len(g) == 1 for g in groups):
        return {"error": "no prompt repeats in the batch: nothing to share (n=1)"}
    with torch.no_grad():
        ours = log_probs_of(probe.model, MicroBatch(batch, packed, groups), probe.temperature, probe.device)[0].cpu()
    mask = batch["response_mask"].float()
    record = gaps(batch["rollout_log_probs"], ours, mask)
    record["actor_first_vs_alone"] = float((ours[:, 0] - alone_first).abs().max())
    return record


def generate(probe: Probe, path: str) -> tuple[Batch, bool]:
    """The engine's greedy rollout on ``path``, assembled as the actor takes it; whether the step was compiled."""
    engine = HFEngine(probe.model, probe.stops, probe.pad, probe.device,
                      static_cache="on" if path == "static" else "off")
    compiled = engine.static is not None and engine.static.compiled
    if compiled:
        torch._dynamo.reset()  # the pinned sdpa backend is baked into a compiled step: trace it anew
    caught, engine_log = BufferingHandler(64), logging.getLogger(HFEngine.__module__)
    caught.setLevel(logging.WARNING)  # the engine says there why its static path fell back to the dynamic loop
    engine_log.addHandler(caught)
    try:
        out = (engine.transformers_generate if path == "generate" else engine.generate)(probe.prompts, probe.params)
    finally:
        engine_log.removeHandler(caught)
    if path == "static" and engine.static is None:
        said = " | ".join(r.getMessage().splitlines()[0] for r in caught.buffer)
        raise RuntimeError(f"static decode fell back to the dynamic loop: {said}")
    return assemble(probe.prompts, out, probe.params.n, probe.family), compiled


def run(probe: Probe, path: str, kind: str, alone: torch.Tensor, tokens: dict[str, torch.Tensor]) -> dict[str, Any]:
    batch, compiled = generate(probe, path)
    tokens[f"{path}|{kind}"] = batch["responses"]
    alone_first = token_log_probs(alone.repeat_interleave(probe.params.n, 0).cpu(), batch["responses"][:, 0],
                                  probe.temperature, suppressed_tokens(probe.model.config))
    engine_first = (batch["rollout_log_probs"][:, 0] - alone_first).abs().max()
    record: dict[str, Any] = {"compiled": compiled, "engine_first_vs_alone": float(engine_first),
                              "response_lengths": [int(x) for x in batch["response_mask"].sum(-1)]}
    with actor_attention(probe.model, kind, probe.device):
        record["actor_attention"] = text_config(probe.model)._attn_implementation  # noqa: SLF001
        record["layouts"] = {layout: guarded(partial(actor, probe, batch, layout, alone_first)) for layout in LAYOUTS}
    logger.info("%s|%s: first-token gaps %s", path, kind,
                {layout: r.get("first", r.get("error")) for layout, r in record["layouts"].items()})
    return record


def attention_runs(probe: Probe, kind: str, tokens: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The prefill check and every decode path under one attention."""
    out: dict[str, Any] = {}
    with attention(probe.model, kind):
        engine = HFEngine(probe.model, probe.stops, probe.pad, probe.device, static_cache="off")
        try:
            with torch.no_grad():
                alone = alone_logits(probe, engine)
        except Exception as err:  # noqa: BLE001
            failed = {"error": one_line(err)}
            return {"prefill": failed, **{f"{path}|{kind}": failed for path in PATHS}}
        out["prefill"] = guarded(partial(prefill_gap, probe, engine, alone))
        for path in PATHS:
            out[f"{path}|{kind}"] = guarded(partial(run, probe, path, kind, alone, tokens))
    return out


def measure(device: torch.device, family: str = "qwen2_5_vl", n: int = 2) -> dict[str, Any]:
    """Every (decode path, attention) pair's engine/actor log-prob gaps on ``device``; see the module's text."""
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        probe = build(device, family, n, tmp)
        tokens: dict[str, torch.Tensor] = {}
        prefills, runs = {}, {}
        try:
            for kind in ATTENTIONS:
                found = attention_runs(probe, kind, tokens)
                prefills[kind] = found.pop("prefill")
                runs.update(found)
        finally:
            torch._dynamo.reset()  # no compiled step of this probe's engines stays behind for the caller
    reference = tokens.get(REFERENCE)
    for name, record in runs.items():
        if name in tokens and reference is not None:
            record["tokens_equal"] = bool(torch.equal(tokens[name], reference))
    return {"device": str(device), "torch": torch.__version__, "transformers": transformers.__version__,
            "family": family, "dtype": "float32", "prompts": len(probe.prompts), "n": n,
            "max_new_tokens": probe.params.max_new_tokens,
            "prompt_lengths": probe.prompts["attention_mask"].sum(-1).tolist(), "reference": REFERENCE,
            "prefill": prefills, "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--family", default="qwen2_5_vl")
    parser.add_argument("--n", type=int, default=2, help="greedy samples per prompt (2: prompts to share)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    text = json.dumps(measure(torch.device(args.device), args.family, args.n), indent=1)
    print(re.sub(r"\{[^{}]*\}|\[[^\[\]{}]*\]", lambda m: " ".join(m.group(0).split()), text))  # leaves inline


if __name__ == "__main__":
    main()
