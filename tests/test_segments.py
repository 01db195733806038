"""Attention by sequence boundaries (easytrain/models/segments.py): what the GPU runs with ``sdpa`` instead of an
S x S mask, checked here against the masked attention it replaces (issue 23, item 2).

The layout's blocks must allow exactly what the block-diagonal mask of packed samples and the prompt-shared mask
allow; attended block by block the outputs and gradients must equal the masked call's; and a real Qwen2.5-VL
switched to it must give the plain passes' log-probs, entropy and gradients, padded, padding-free and
prompt-shared, with transformers building no mask for the packed and shared forwards."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from easytrain.models.segments import (ATTENTION, Block, attend, mask_outside_layouts, packed_blocks, segment_attention,
                                       segments, shared_blocks)
from easytrain.workers.forward import log_probs_of
from easytrain.models.families import family_of
from easytrain.workers.shared_prompt import prompt_groups, shared_inputs

from rl_batches import assert_same_pass, grads, planned, rl_config, rollout_batch
from test_shared_prompt import actor_model

CPU = torch.device("cpu")


def allowed_by(layout: list[list[Block]], length: int) -> torch.Tensor:
    """The (rows, L, L) boolean mask a layout stands for."""
    out = torch.zeros(len(layout), length, length, dtype=torch.bool)
    for row, blocks in enumerate(layout):
        for block in blocks:
            a, e = block.prefix
            out[row, a:e, a:e] = torch.ones(e - a, e - a, dtype=torch.bool).tril()
            for c, d in block.parts:
                out[row, c:d, a:e] = True
                out[row, c:d, c:d] = torch.ones(d - c, d - c, dtype=torch.bool).tril()
    return out


def test_packed_blocks_are_the_block_diagonal_causal_mask() -> None:
    positions = torch.cat([torch.arange(n) for n in (5, 1, 9, 3)])
    layout = packed_blocks(positions)
    assert [b.prefix for b in layout[0]] == [(0, 5), (5, 6), (6, 15), (15, 18)]
    sample = torch.repeat_interleave(torch.arange(4), torch.tensor([5, 1, 9, 3]))
    want = (sample[:, None] == sample[None, :]) & torch.ones(18, 18, dtype=torch.bool).tril()
    assert torch.equal(allowed_by(layout, 18)[0], want)


@pytest.mark.parametrize("shared", [False, True])
def test_attention_block_by_block_equals_the_masked_call(shared: bool) -> None:
    """float64, so the two summation orders agree to rounding: outputs and all three gradients."""
    generator = torch.Generator().manual_seed(0)
    if shared:  # row 0: a prompt of 6 and responses of 3, 1 and 4, then padding; row 1: prompt 4, responses 2, 2
        layout = [[Block((0, 6), ((6, 9), (9, 10), (10, 14))), Block((14, 16))],
                  [Block((0, 4), ((4, 6), (6, 8))), Block((8, 16))]]
    else:
        layout = [packed_blocks(torch.cat([torch.arange(n) for n in (7, 2, 5, 2)]))[0]] * 2
    q = torch.randn(2, 4, 16, 8, dtype=torch.float64, generator=generator, requires_grad=True)
    k = torch.randn(2, 2, 16, 8, dtype=torch.float64, generator=generator, requires_grad=True)  # grouped-query
    v = torch.randn(2, 2, 16, 8, dtype=torch.float64, generator=generator, requires_grad=True)
    allowed = allowed_by(layout, 16)[:, None]
    out = attend(q, k, v, layout)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    weight = torch.randn(out.shape, dtype=torch.float64, generator=generator)
    for got, expected in zip(torch.autograd.grad((out * weight).sum(), (q, k, v)),
                             torch.autograd.grad((want * weight).sum(), (q, k, v))):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_a_layout_must_cover_the_row() -> None:
    q = torch.zeros(1, 1, 8, 4)
    with pytest.raises(ValueError, match="covers 5 of the row's 8 positions"):
        attend(q, q, q, [[Block((0, 5))]])


def test_shared_blocks_allow_what_the_shared_mask_allows(tmp_path: Path) -> None:
    config = rl_config(tmp_path, "worker.rollout.n=4")
    batch = rollout_batch(config)
    groups = prompt_groups(batch)
    for one_row in (False, True):
        masked, _, _ = shared_inputs(batch, groups, family_of({"model_type": "qwen2_5_vl"}), torch.float32, eager=False, one_row=one_row)
        blocked, _, _ = shared_inputs(batch, groups, family_of({"model_type": "qwen2_5_vl"}), torch.float32, eager=False, one_row=one_row, blocks=True)
        mask = masked["attention_mask"][:, 0]
        length = mask.shape[-1]
        layout = blocked["layout"]
        assert len(layout) == mask.shape[0] and "attention_mask" not in blocked
        real = blocked["input_ids"] != 0  # padding columns' outputs are never read: only real rows compared
        for row in range(mask.shape[0]):
            keep = real[row]
            assert torch.equal(allowed_by(layout, length)[row][keep][:, keep], mask[row][keep][:, keep])


@pytest.mark.parametrize("packed, share", [(False, False), (True, False), (True, True), (False, True)])
def test_a_model_on_segments_gives_the_plain_passes(packed: bool, share: bool, tmp_path: Path) -> None:
    from transformers import AttentionInterface

    config = rl_config(tmp_path, "worker.rollout.n=4")
    batch = rollout_batch(config)
    model = actor_model(config)
    mask = batch["response_mask"].bool()

    def run() -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        lp, entropy = log_probs_of(model, planned(batch, model, packed, share), 1.0, CPU, with_entropy=True)
        (lp[mask] * torch.linspace(-1, 1, int(mask.sum()))).sum().backward()
        return lp.masked_fill(~mask, 0), entropy, grads(model)  # the padded pass leaves values off the mask

    plain = run()
    from easytrain.models.segments import apply_segment_attention

    apply_segment_attention(model)
    calls: list[dict[str, Any]] = []

    def recording(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                  **kwargs: Any) -> Any:
        from easytrain.models.segments import active

        calls.append({"layout": active() is not None, "mask": attention_mask is not None})
        return segment_attention(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(ATTENTION, recording)
    try:
        assert_same_pass(run(), plain, mask)
    finally:
        AttentionInterface.register(ATTENTION, segment_attention)
    layers = model.config.text_config.num_hidden_layers
    assert len(calls) == layers
    if packed or share:  # the packed and the shared forwards: blocks, and transformers built no mask
        assert all(c["layout"] and not c["mask"] for c in calls)
    else:  # a padded pass: plain sdpa with the padding mask
        assert all(not c["layout"] and c["mask"] for c in calls)


def test_no_mask_is_built_inside_a_layout() -> None:
    with segments([[Block((0, 4))]]):
        assert mask_outside_layouts(batch_size=1, cache_position=torch.arange(4), kv_length=4) is None
