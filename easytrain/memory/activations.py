"""Activation and logits bytes of one micro batch, counted tensor by tensor from the model's code path.

The counts follow what autograd keeps for the backward pass of transformers'
decoder and vision layers as easytrain runs them (sdpa or flash attention, no
dropout), per token and layer, in the compute dtype; where families differ,
the family's adapter (:mod:`easytrain.models.families`) says which trait
applies:

- decoder layer: its input and the first norm's output (2h); the roped q, k
  and v that attention keeps (q + 2kv; the rope's products keep no q or k
  themselves, autograd saves an input only when the other side needs a
  gradient, and cos/sin need none); the attention output and its re-laid-out
  copy that o_proj keeps (2q); the residual sum and the second norm's output
  (2h); the MLP's gate, SiLU, up and product (4i). Multimodal rotary
  positions (``rope_rows``) add their per-layer cos/sin (2 x head_dim).
  ``eager`` attention adds the attention weights (2 x heads x s per token).
  Per-head q/k norms (``qk_norm``) keep their inputs (q + kv); sandwich norms
  (``sandwich_norm``) each sub-layer's output (2h). A mixture-of-experts MLP
  counts as the experts a token is routed to (``num_experts_per_tok x
  moe_intermediate_size`` wide).
- vision block (per patch, before the merge): two norms (4 hv), the qkv
  output that v still views (3 hv), q and k as attention takes them (2 hv),
  the attention output and its copy (2 hv), and the MLP (4 iv gated,
  ``gated_vision_mlp``; 2 iv for fc1 / activation / fc2).
- gradient checkpointing keeps only each layer's input (h per token and layer)
  plus one layer recomputed during backward.
- without gradients (log-prob passes) only one layer's working set is alive.

The logits cost is counted separately: the actor keeps only the response
positions' logits, then its loss (easytrain.algorithms.losses) makes scaled
copies, two log-softmaxes, an exp and a mask over them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from easytrain.memory.states import FP32

PATCH_VALUES = 3 * 2 * 14 * 14
"""Floats of one 14-px vision patch over two frames in ``pixel_values`` (RGB x 2 x 14 x 14): the default geometry;
a model's own is :attr:`ModelDims.values_per_token` / merge^2 (:mod:`easytrain.memory.vision`)."""


@dataclass(frozen=True)
class ModelDims:
    hidden: int
    layers: int
    q: int
    """Query width: heads x head_dim."""
    kv: int
    """Key (= value) width: KV heads x head_dim."""
    heads: int
    head_dim: int
    intermediate: int
    vocab: int
    mrope: bool
    vision_hidden: int = 0
    vision_layers: int = 0
    vision_intermediate: int = 0
    vision_gated: bool = True
    merge: int = 2
    """Patches per language-model token along a side (the vision tower sees merge^2 patches per token)."""
    values_per_token: int = 4 * PATCH_VALUES
    """fp32 ``pixel_values`` values behind one image token (its merge^2 patches)."""
    qk_norm: bool = False
    sandwich_norm: bool = False


def mlp_width(text: Any) -> int:
    """Intermediate width of the MLP one token runs: a dense MLP's ``intermediate_size``, or for a
    mixture-of-experts model (every layer sparse) the ``num_experts_per_tok`` experts it is routed to."""
    experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)
    chosen = getattr(text, "num_experts_per_tok", None)
    moe = getattr(text, "moe_intermediate_size", None)
    dense_layers = getattr(text, "mlp_only_layers", None) or []
    if experts and chosen and moe and not dense_layers and getattr(text, "decoder_sparse_step", 1) == 1:
        return chosen * moe
    return text.intermediate_size


def _vision_dims(vision: Any) -> dict[str, Any]:
    """The vision tower's width, depth and MLP width, from whichever names its config uses: ``embed_dim`` /
    ``depth`` / ``mlp_ratio`` (where ``hidden_size`` is the merger's output), or ``hidden_size`` / ``depth`` or
    ``num_hidden_layers`` / ``intermediate_size``."""
    if hasattr(vision, "embed_dim") and hasattr(vision, "mlp_ratio"):  # a width and an MLP ratio
        width = vision.embed_dim
        return dict(vision_hidden=width, vision_layers=vision.depth, vision_intermediate=int(width * vision.mlp_ratio))
    layers = getattr(vision, "depth", None) or vision.num_hidden_layers
    return dict(vision_hidden=vision.hidden_size, vision_layers=layers, vision_intermediate=vision.intermediate_size)


@lru_cache(maxsize=64)
def _dims(key: str) -> ModelDims:
    import json

    from easytrain.memory.params import hf_config_object
    from easytrain.memory.vision import vision_geometry
    from easytrain.models.families import family_of

    hf_config = json.loads(key)
    config = hf_config_object(hf_config)
    text = config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    vision = getattr(config, "vision_config", None)
    family = family_of(hf_config)  # its adapter knows the traits the config does not spell out
    dims = dict(hidden=text.hidden_size, layers=text.num_hidden_layers, heads=text.num_attention_heads,
                q=text.num_attention_heads * head_dim, kv=text.num_key_value_heads * head_dim, head_dim=head_dim,
                intermediate=mlp_width(text), vocab=text.vocab_size, mrope=family.rope_rows,
                qk_norm=family.qk_norm, sandwich_norm=family.sandwich_norm)
    geometry = vision_geometry(hf_config)
    if vision is not None and geometry is not None:
        dims.update(_vision_dims(vision), vision_gated=family.gated_vision_mlp,
                    merge=geometry.merge, values_per_token=geometry.values_per_token)
    return ModelDims(**dims)


def model_dims(hf_config: dict[str, Any]) -> ModelDims:
    import json

    return _dims(json.dumps(hf_config, sort_keys=True))


def layer_saved(d: ModelDims) -> int:
    """Elements one decoder layer keeps per token for backward."""
    rope = 2 * d.head_dim if d.mrope else 0
    norms = (d.q + d.kv if d.qk_norm else 0) + (2 * d.hidden if d.sandwich_norm else 0)
    return 4 * d.hidden + 3 * d.q + 2 * d.kv + 4 * d.intermediate + rope + norms


def layer_working(d: ModelDims) -> int:
    """Elements per token alive at once inside one decoder layer without gradients (the MLP's peak:
    residual, normed input, gate/up/activation outputs)."""
    return 2 * d.hidden + 3 * d.intermediate


def vision_block_saved(d: ModelDims) -> int:
    """Elements one vision block keeps per patch for backward."""
    return 11 * d.vision_hidden + (4 if d.vision_gated else 2) * d.vision_intermediate


@dataclass(frozen=True)
class MicroShape:
    """The shape of one planned micro batch, as the planner prices it."""

    sequences: int
    tokens: int
    """Positions per sequence (prompt incl. image tokens + response)."""
    response: int
    images: int
    """Images per sequence."""
    image_tokens: int
    """Language-model tokens per image, after the merge (:mod:`easytrain.memory.vision`)."""


def packed_micro(budget: int, sample_tokens: int, response: int, images: int, image_tokens: int) -> MicroShape:
    """A padding-free micro batch: one flattened sequence of ``budget`` tokens (batch dimension 1) holding as
    many full-length samples of ``sample_tokens`` as fit (at least one): their images and their ``response``
    positions each (``MicroShape.response`` is then the whole sequence's response positions)."""
    samples = max(1, budget // sample_tokens)
    return MicroShape(1, budget, samples * response, samples * images, image_tokens)


def activation_bytes(d: ModelDims, mb: MicroShape, dtype_bytes: int, *, grad: bool, checkpointing: bool,
                     vision_grad: bool, eager: bool = False, ulysses: int = 1) -> int:
    """Peak activation bytes of one forward (and, with ``grad``, what it keeps for backward) of a micro
    batch, excluding the logits. ``ulysses`` ranks split every sequence, dividing the per-token terms."""
    tokens = mb.sequences * mb.tokens
    patches = mb.sequences * mb.images * mb.image_tokens * d.merge * d.merge
    attention = 2 * d.heads * mb.tokens if eager else 0  # weights + softmax per token, per layer
    pixels = mb.sequences * mb.images * mb.image_tokens * d.values_per_token * FP32
    if not grad:
        text = tokens * (layer_working(d) + 2 * d.hidden + attention)  # + embeddings and the final norm
        vision = patches * (6 * d.vision_hidden + 3 * d.vision_intermediate) if patches else 0
        return pixels + (max(text, vision) + tokens * d.hidden) * dtype_bytes // ulysses
    per_layer = layer_saved(d) + attention
    if checkpointing:
        text = tokens * (d.layers * d.hidden + per_layer)
    else:
        text = tokens * d.layers * per_layer
    text += tokens * (4 * d.hidden + 2 * d.intermediate)  # embeddings, final norm, one layer's backward grads
    vision = 0
    if patches and vision_grad:
        block = vision_block_saved(d)
        vision = patches * ((d.vision_layers * d.vision_hidden + block) if checkpointing
                            else d.vision_layers * block)
        vision += patches * 4 * d.vision_hidden  # patch embedding, merger norm and MLP
    return pixels + (text + vision) * dtype_bytes // ulysses


def logits_bytes(sequences: int, positions: int, vocab: int, dtype_bytes: int, *, grad: bool) -> int:
    """Peak bytes of the logits and the loss over them for ``positions`` per sequence.

    Without gradients: the model's logits plus the fp32 scaled copy and its log-softmax. With gradients
    (the update, which also computes the entropy): the logits, the scaled copy, two log-softmaxes, exp,
    the masked copy and its product (fp32) and the isinf mask (1 byte), all alive at the end of forward.
    """
    elements = sequences * positions * vocab
    if not grad:
        return elements * (dtype_bytes + 2 * FP32)
    return elements * (dtype_bytes + 6 * FP32 + 1)


def sft_logits_bytes(positions: int, vocab: int, *, grad: bool) -> int:
    """Peak bytes of the SFT loss over ``positions`` (every sequence's summed): the logits cast to fp32 and
    their log-softmax (cross-entropy), alive at the end of forward; with ``grad``, at the start of backward
    the log-softmax saved for it, the dense gradient the NLL hands back and the log-softmax's input gradient
    (fp32 each). The compute-dtype logits live only while being cast (fewer bytes than either peak)."""
    return positions * vocab * (3 if grad else 2) * FP32


def shard_units(hf_config: dict[str, Any]) -> tuple[int, int]:
    """Elements of FSDP's root unit (embeddings, head, vision patch embedding and merger) and of one decoder
    block (attention and MLP weights, counted as h x h per projection)."""
    from easytrain.memory.params import count_parameters

    dims = model_dims(hf_config)
    counts = count_parameters(hf_config)
    block = 4 * dims.hidden * dims.hidden + 3 * dims.hidden * dims.intermediate
    if counts.experts:  # a mixture-of-experts block holds every expert, not the ones a token uses
        block = max(block, counts.language_model // dims.layers)
    return counts.embeddings + counts.lm_head + counts.projector, block
