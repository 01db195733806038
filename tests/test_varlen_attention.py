"""Attention of packed sequences by their boundaries (easytrain/models/varlen.py, issue 32 item 4), on CPU.

What a CPU can check of the GPU path: the kernel arguments built from easytrain's boundaries (the same sequences as
the batch's attention mask, the position restarts and Ulysses' sample index; for shared prompts, exactly the pairs
the shared mask allows), the choice of kernel for a device, dtype and what this machine has installed, and the
maths the variable-length kernels are given, run by a per-sequence reference on those very inputs, against a
dense masked attention. The kernels themselves run on CUDA only (tests/gpu/test_varlen_gpu.py). Also here: the
recomputation of gradient checkpointing keeps the forward's layout, and the update's MFU."""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path

import pytest
import torch

from easytrain.distributed.batch import Batch
from easytrain.distributed.ulysses import length as ulysses_length
from easytrain.models import segments as seg
from easytrain.models.segments import Block, active, attend, packed_blocks, segments
from easytrain.models.varlen import (FLASH_ATTN, REFERENCE, SDPA_BLOCKS, TORCH_VARLEN, choose_kernel, cu_seqlens,
                                     flash_attn_function, kernel_for, plan_layout, torch_varlen_function, varlen_call)
from easytrain.trainer.mfu import (attended_pairs, attention_flops, causal_pairs, peak_bf16_flops, update_mfu)
from easytrain.workers.packed import flatten, sample_positions
from easytrain.models.families import family_of
from easytrain.workers.shared_prompt import prompt_groups, shared_inputs

from rl_batches import grads, planned, rl_config, rollout_batch
from test_segments import allowed_by

SHARED = [[Block((0, 6), ((6, 9), (9, 10), (10, 14))), Block((14, 16))],
          [Block((0, 4), ((4, 6), (6, 8))), Block((8, 16))]]
"""Row 0: a prompt of 6 with responses of 3, 1 and 4, then a padding run; row 1: a prompt of 4, responses 2 and 2."""
PACKED_LENGTHS = (7, 2, 5, 2)


def allowed_by_plan(layout: list[list[Block]], length: int) -> torch.Tensor:
    """The (rows, L, L) mask the plan's sequences give a causal variable-length kernel: query t of a sequence of
    q queries and k keys sees its first k - q + t + 1 keys (bottom-right alignment)."""
    plan = plan_layout(layout, length)
    flat = torch.zeros(plan.rows * length, plan.rows * length, dtype=torch.bool)
    cu_q, cu_k = plan.cu_seq_q.tolist(), plan.cu_seq_k.tolist()
    index = plan.key_index if plan.key_index is not None else torch.arange(plan.rows * length)
    for i in range(plan.sequences):
        queries, keys = cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i]
        for t in range(queries):
            flat[cu_q[i] + t, index[cu_k[i]:cu_k[i] + keys - queries + t + 1]] = True
    rows = [flat[r * length:(r + 1) * length, r * length:(r + 1) * length] for r in range(plan.rows)]
    assert flat.sum() == sum(int(r.sum()) for r in rows)  # nothing crosses rows
    return torch.stack(rows)


def padded_batch(lengths: list[int], width: int) -> Batch:
    """Left-padded rows of ``lengths`` tokens, positions counting from each row's first token."""
    mask = (torch.arange(width)[None] >= width - torch.tensor(lengths)[:, None]).long()
    ids = torch.randint(5, 100, (len(lengths), width)) * mask
    return Batch({"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)})


# --- cu_seqlens from easytrain's boundaries --------------------------------------------------------------------------


def test_cu_seqlens_of_a_packed_micro_batch_are_its_rows_and_ulysses_samples() -> None:
    lengths = [5, 1, 9, 3]
    inputs = flatten(padded_batch(lengths, 10), family_of({"model_type": "qwen2"}))
    positions = sample_positions(inputs)
    plan = plan_layout(packed_blocks(positions), positions.shape[-1])
    rows = inputs["input_ids"].shape[1]
    assert torch.equal(plan.cu_seq_q, torch.tensor([0, 5, 6, 15, 18], dtype=torch.int32))
    assert torch.equal(plan.cu_seq_q, cu_seqlens(lengths)) and torch.equal(plan.cu_seq_k, plan.cu_seq_q)
    assert plan.cu_seq_q[-1] == rows == sum(lengths) and (plan.max_q, plan.max_k) == (9, 9)
    assert plan.key_index is None  # packed samples: the keys are the queries, nothing to gather
    with segments(packed_blocks(positions)):  # what Ulysses splits and attends by
        (row,) = active()  # type: ignore[misc]
        assert [b.prefix[1] - b.prefix[0] for b in row] == plan.cu_seq_q.diff().tolist() == lengths
        assert ulysses_length([row]) == rows


def test_cu_seqlens_of_the_vision_rows_follow_the_text_position() -> None:
    """Qwen-VL's four rows of positions: the first (text) marks where samples start, the rope rows do not."""
    batch = padded_batch([4, 6], 6)
    rope = torch.stack([batch["position_ids"], batch["position_ids"] // 2, batch["position_ids"] * 0])
    inputs = flatten(Batch({**batch.tensors, "position_ids": rope}), family_of({"model_type": "qwen2_5_vl"}))
    assert inputs["position_ids"].shape == (4, 1, 10)
    plan = plan_layout(packed_blocks(sample_positions(inputs)), 10)
    assert plan.cu_seq_q.tolist() == [0, 4, 10]


def test_a_shared_plan_allows_exactly_the_shared_mask() -> None:
    plan = plan_layout(SHARED, 16)
    # row 0: prompt, 3 responses, padding; row 1 (from 16): prompt, 2 responses, padding
    assert plan.cu_seq_q.tolist() == [0, 6, 9, 10, 14, 16, 20, 22, 24, 32]
    assert plan.cu_seq_k.diff().tolist() == [6, 9, 7, 10, 2, 4, 6, 6, 8]
    assert (plan.max_q, plan.max_k) == (8, 10)
    assert plan.key_index is not None and plan.key_index[6:15].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8]
    assert torch.equal(allowed_by_plan(SHARED, 16), allowed_by(SHARED, 16))


def test_the_plan_of_real_shared_rows_allows_what_the_shared_mask_allows(tmp_path: Path) -> None:
    config = rl_config(tmp_path, "worker.rollout.n=4")
    batch = rollout_batch(config)
    groups = prompt_groups(batch)
    for one_row in (False, True):
        masked, _, _ = shared_inputs(batch, groups, family_of({"model_type": "qwen2_5_vl"}), torch.float32, eager=False, one_row=one_row)
        blocked, _, _ = shared_inputs(batch, groups, family_of({"model_type": "qwen2_5_vl"}), torch.float32, eager=False, one_row=one_row, blocks=True)
        mask = masked["attention_mask"][:, 0]
        length = mask.shape[-1]
        allowed = allowed_by_plan(blocked["layout"], length)
        real = blocked["input_ids"] != 0  # padding columns' outputs are never read
        for row in range(mask.shape[0]):
            keep = real[row]
            assert torch.equal(allowed[row][keep][:, keep], mask[row][keep][:, keep])


def test_a_plan_must_cover_each_column_once() -> None:
    with pytest.raises(ValueError, match="covers 5 of the row's 8 positions"):
        plan_layout([[Block((0, 5))]], 8)
    with pytest.raises(ValueError, match="covers 8 of the row's 8 positions, not each exactly once"):
        plan_layout([[Block((0, 4)), Block((2, 4)), Block((6, 8))]], 8)


# --- which kernel --------------------------------------------------------------------------------------------------


def test_the_kernel_follows_device_dtype_head_dim_and_what_is_installed() -> None:
    def pick(prefer: str = "auto", device: str = "cuda", dtype: torch.dtype = torch.bfloat16, head_dim: int = 128,
             capability: tuple[int, int] | None = (9, 0), flash: bool = True, varlen: bool = True) -> str:
        return choose_kernel(prefer, device, dtype, head_dim, capability, flash_attn_installed=flash,
                             torch_varlen_present=varlen)

    assert pick() == TORCH_VARLEN  # flash-attn only when the run asked for it
    assert pick("flash_attn") == FLASH_ATTN
    assert pick("flash_attn", flash=False) == TORCH_VARLEN
    assert pick(dtype=torch.float16) == TORCH_VARLEN
    assert pick(varlen=False) == SDPA_BLOCKS  # torch without varlen_attn (< 2.9): today's path
    assert pick("sdpa_blocks") == SDPA_BLOCKS
    for case in ({"device": "cpu", "capability": None}, {"dtype": torch.float32}, {"head_dim": 100},
                 {"head_dim": 512}, {"capability": (7, 5)}):
        assert pick(**case) == SDPA_BLOCKS, case
        assert pick("flash_attn", **case) == SDPA_BLOCKS, case
    assert pick("reference", device="cpu", dtype=torch.float32, capability=None) == REFERENCE  # tests only
    with pytest.raises(ValueError, match="choose one of auto, flash_attn, torch_varlen, sdpa_blocks, reference"):
        pick("xformers")


def test_the_kernel_with_what_this_machine_has() -> None:
    """No mocks: this torch's varlen_attn and this environment's flash-attn, as the dispatcher finds them."""
    module = importlib.util.find_spec("torch.nn.attention.varlen")
    has_varlen = module is not None and hasattr(importlib.import_module("torch.nn.attention.varlen"), "varlen_attn")
    assert (torch_varlen_function() is not None) == has_varlen
    assert (flash_attn_function() is not None) <= (importlib.util.find_spec("flash_attn") is not None)
    cpu = torch.zeros(1, 2, 4, 64, dtype=torch.bfloat16)
    assert kernel_for(cpu) == SDPA_BLOCKS and kernel_for(cpu, "flash_attn") == SDPA_BLOCKS  # never a CUDA kernel
    on_h100 = choose_kernel("auto", "cuda", torch.bfloat16, 128, (9, 0),
                            flash_attn_installed=flash_attn_function() is not None,
                            torch_varlen_present=torch_varlen_function() is not None)
    assert on_h100 == (TORCH_VARLEN if has_varlen else SDPA_BLOCKS)
    if torch.cuda.is_available():
        assert kernel_for(cpu.cuda()) in (TORCH_VARLEN, SDPA_BLOCKS)


def test_the_varlen_call_fits_this_torch_and_earlier_signatures() -> None:
    function = torch_varlen_function()
    if function is not None:  # this torch's own signature
        params = inspect.signature(function).parameters
        call = varlen_call(params, 0.125, 64, 4, 2)
        assert set(call.kwargs) <= set(params)
        assert call.kwargs.get("window_size", (-1, 0)) == (-1, 0) and call.kwargs.get("is_causal", True)
        assert (call.query_factor, call.repeat_kv) == (1.0, 1) or "enable_gqa" not in params
    newer = varlen_call({"window_size", "scale", "enable_gqa"}, 0.125, 64, 4, 2)
    assert newer.kwargs == {"window_size": (-1, 0), "scale": 0.125, "enable_gqa": True} and newer.repeat_kv == 1
    windowed = varlen_call({"window_size", "scale"}, 0.125, 64, 4, 2)  # no enable_gqa: heads repeated
    assert windowed.kwargs == {"window_size": (-1, 0), "scale": 0.125} and windowed.repeat_kv == 2
    first = varlen_call({"is_causal", "return_aux"}, 0.125, 64, 4, 4)  # no scale: folded into the queries
    assert first.kwargs == {"is_causal": True} and first.query_factor == pytest.approx(1.0)
    assert varlen_call({"is_causal"}, 0.5, 64, 4, 4).query_factor == pytest.approx(4.0)


# --- the maths the kernels are given -----------------------------------------------------------------------------


def fp32_bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> float:
    """How far two float32 attentions over the same allowed keys can differ, from the tensors themselves.

    With unit roundoff u = 2^-24 and gamma_n = n u / (1 - n u): a score is a D-term dot product, off by at most
    gamma_D * scale * sum_d |q_d k_d|; softmax moves by at most 2 max|d score| in L1 (first order), and its
    normalisation and the weighted sum of at most L values add gamma_L each; the output moves by the weights'
    L1 change times max|v|. Two computations (the reference's per-sequence calls, the dense masked call) differ by
    at most the sum of their bounds: 2 max|v| (2 gamma_D scale max_ij sum_d |q_id k_jd| + 2 gamma_L)."""
    u = 2.0 ** -24
    gamma = lambda n: n * u / (1 - n * u)  # noqa: E731
    heads, kv_heads, length, dim = q.shape[1], k.shape[1], q.shape[2], q.shape[3]
    k_full = k.repeat_interleave(heads // kv_heads, dim=1)
    products = torch.einsum("bhid,bhjd->bhij", q.abs().double(), k_full.abs().double())
    score = gamma(dim) * scale * float(products.max())
    return 2 * float(v.abs().max()) * (2 * score + 2 * gamma(length))


@pytest.mark.parametrize("shared", [False, True])
def test_the_plan_through_the_reference_kernel_is_the_dense_masked_attention(shared: bool) -> None:
    generator = torch.Generator().manual_seed(0)
    layout = SHARED if shared else [packed_blocks(torch.cat([torch.arange(n) for n in PACKED_LENGTHS]))[0]] * 2
    allowed = allowed_by(layout, 16)[:, None]
    q = torch.randn(2, 4, 16, 8, generator=generator)  # grouped-query: 4 query heads over 2 key/value heads
    k = torch.randn(2, 2, 16, 8, generator=generator)
    v = torch.randn(2, 2, 16, 8, generator=generator)
    scale = 8 ** -0.5
    out = attend(q, k, v, layout, scale, kernel=REFERENCE)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=True)
    bound = fp32_bound(q, k, v, scale)
    assert bound < 1e-4  # a bound that means something for outputs of order 1
    torch.testing.assert_close(out, want, rtol=0, atol=bound)
    # float64: the same function, outputs and all three gradients to rounding
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    out = attend(q64, k64, v64, layout, scale, kernel=REFERENCE)
    want = torch.nn.functional.scaled_dot_product_attention(q64, k64, v64, attn_mask=allowed, scale=scale,
                                                            enable_gqa=True)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    weight = torch.randn(out.shape, dtype=torch.float64, generator=generator)
    for got, expected in zip(torch.autograd.grad((out * weight).sum(), (q64, k64, v64)),
                             torch.autograd.grad((want * weight).sum(), (q64, k64, v64))):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_the_plan_is_built_once_per_layout_and_device() -> None:
    q = torch.randn(1, 2, 16, 8)
    layout = [packed_blocks(torch.cat([torch.arange(n) for n in PACKED_LENGTHS]))[0]]
    with segments(layout):
        scope = seg._active[0]
        assert scope is not None
        first = attend(q, q, q, layout, kernel=REFERENCE)
        plan = scope.plans[(16, "cpu")]
        assert torch.equal(attend(q, q, q, layout, kernel=REFERENCE), first)
        assert scope.plans == {(16, "cpu"): plan}
    with pytest.raises(ValueError, match="a layout of 1 rows for 2 rows"):
        attend(q.expand(2, -1, -1, -1), q.expand(2, -1, -1, -1), q.expand(2, -1, -1, -1), layout, kernel=REFERENCE)


def test_attend_logs_and_records_the_kernel_it_chose(caplog: pytest.LogCaptureFixture) -> None:
    q = torch.randn(1, 2, 8, 8)
    seg._used.pop(SDPA_BLOCKS, None)
    with caplog.at_level("INFO", logger="easytrain.models.segments"):
        attend(q, q, q, [[Block((0, 8))]])
        attend(q, q, q, [[Block((0, 8))]])
    assert seg.used_kernels()[SDPA_BLOCKS] == "float32 on cpu"  # CPU: the block-by-block path
    assert sum("sdpa_blocks (float32 on cpu" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("packed, share", [(True, False), (True, True), (False, True)])
def test_a_model_on_the_varlen_path_gives_the_plain_passes(packed: bool, share: bool, tmp_path: Path) -> None:
    """A real Qwen2.5-VL whose packed and prompt-shared passes go through the variable-length path (flattening,
    plan, key gather, the reference kernel in place of the CUDA one): the plain passes' log-probs, entropy and
    gradients; and every layer's attention ran on the varlen path."""
    from easytrain.models.segments import apply_segment_attention
    from easytrain.workers.forward import log_probs_of
    from rl_batches import assert_same_pass
    from test_shared_prompt import actor_model

    config = rl_config(tmp_path, "worker.rollout.n=4")
    batch = rollout_batch(config)
    model = actor_model(config)
    mask = batch["response_mask"].bool()

    def run() -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        lp, entropy = log_probs_of(model, planned(batch, model, packed, share), 1.0, torch.device("cpu"),
                                   with_entropy=True)
        (lp[mask] * torch.linspace(-1, 1, int(mask.sum()))).sum().backward()
        return lp.masked_fill(~mask, 0), entropy, grads(model)

    plain = run()
    apply_segment_attention(model, kernel=REFERENCE)
    calls: list[str] = []
    original = seg._attend_varlen

    def recording(*args: object) -> torch.Tensor:
        calls.append(str(args[-1]))
        return original(*args)  # type: ignore[arg-type]

    seg._attend_varlen = recording  # type: ignore[assignment]
    try:
        assert_same_pass(run(), plain, mask)
    finally:
        seg._attend_varlen = original  # type: ignore[assignment]
        apply_segment_attention(model, kernel="auto")
    assert calls == [REFERENCE] * model.config.text_config.num_hidden_layers


# --- gradient checkpointing: the recomputation keeps the forward's layout ------------------------------------------


@pytest.mark.parametrize("share", [False, True])
def test_checkpointed_layers_recompute_with_the_forward_layout(share: bool, tmp_path: Path) -> None:
    """Backward runs after the forward's segments() context has closed; a checkpointed layer recomputed there
    would attend the packed row as one causal sequence (torch notices the different saved tensors) unless
    checkpoint_contexts restores the layout."""
    from torch.utils.checkpoint import CheckpointError

    from easytrain.models.segments import apply_segment_attention, checkpoint_contexts
    from easytrain.workers.forward import log_probs_of
    from test_shared_prompt import actor_model

    config = rl_config(tmp_path, "worker.rollout.n=4")
    batch = rollout_batch(config)
    model = actor_model(config)
    apply_segment_attention(model)
    mask = batch["response_mask"].bool()
    weights = torch.linspace(-1, 1, int(mask.sum()))

    def step() -> dict[str, torch.Tensor]:
        lp, _ = log_probs_of(model, planned(batch, model, True, share), 1.0, torch.device("cpu"))
        (lp[mask] * weights).sum().backward()
        return grads(model)

    model.train()
    plain = step()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with pytest.raises(CheckpointError):
        step()
    model.zero_grad(set_to_none=True)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False,
                                                                       "context_fn": checkpoint_contexts})
    checkpointed = step()
    assert checkpointed.keys() == plain.keys()
    for name, value in plain.items():
        torch.testing.assert_close(checkpointed[name], value, rtol=1e-5, atol=1e-7, msg=name)


# --- MFU -----------------------------------------------------------------------------------------------------------


def test_update_mfu_and_the_peaks_by_device_name() -> None:
    assert peak_bf16_flops("NVIDIA H100 80GB HBM3") == pytest.approx(989.4e12)  # SXM
    assert peak_bf16_flops("NVIDIA H100 PCIe") == pytest.approx(756e12)
    assert peak_bf16_flops("NVIDIA H200") == pytest.approx(989.4e12)
    assert peak_bf16_flops("NVIDIA A100-SXM4-80GB") == pytest.approx(312e12)
    assert peak_bf16_flops("NVIDIA H100 NVL") is None and peak_bf16_flops("NVIDIA H200 NVL") is None
    assert peak_bf16_flops("NVIDIA GeForce RTX 4090") is None
    # 3.45B parameters, 8192 tokens in 1 s on an H100 SXM: 6 * 3.45e9 * 8192 / 989.4e12
    assert update_mfu(3_450_000_000, 8192, 1.0, 989.4e12) == pytest.approx(0.17140, abs=1e-5)
    assert update_mfu(10, 10, 2.0, 100.0, attention_flops=200.0) == pytest.approx((600 + 200) / 2 / 100)
    with pytest.raises(ValueError, match="positive seconds"):
        update_mfu(1, 1, 0.0, 1.0)


def test_attention_flops_count_the_pairs_a_layout_attends() -> None:
    assert causal_pairs([3, 1]) == 6 + 1
    packed = [packed_blocks(torch.cat([torch.arange(n) for n in PACKED_LENGTHS]))[0]]
    assert attended_pairs(packed) == causal_pairs(PACKED_LENGTHS)
    assert attended_pairs(SHARED) == int(allowed_by(SHARED, 16).sum())
    assert attention_flops(10, layers=2, heads=4, head_dim=8) == 12 * 10 * 4 * 8 * 2
