"""Comparing two trainings' weights: the tolerance follows from the update and from how AdamW treats rounding.

Two runs that train the same model on the same data by different routes (one rank or several, FSDP2 or
DeepSpeed ZeRO, offloaded or not, sequence-parallel or not) sum their gradients in different orders, so each
gradient element differs between them by its fp32 rounding noise: about 1e-7 of the terms summed into it, a few
1e-10 for this repo's tiny models (gradients of median ~5e-4). AdamW turns gradients into steps through
``m / (sqrt(v) + eps)`` (first step: ``lr * g / (|g| + eps)``), which depends on a gradient only through ratios
of its own history:

- an element whose gradient is far above its rounding noise steps by ``lr`` times a ratio that the noise moves
  by its relative size, ``rho`` (the losses and gradient norms of such runs agree to ``rho <= 1e-4``). The two
  runs' weights then differ by ``rho`` of the update, plus the rounding of the weight itself (an fp32 ulp per
  step). ``rtol = 1e-3`` of the tensor's largest update leaves 10x room above ``rho``.
- an element whose gradient is as small as Adam's ``eps`` (1e-8) or smaller is different: ``lr * g / (|g| + eps)``
  has slope ``lr / eps`` at 0, so a rounding difference of 1e-9 in ``g`` moves the step by up to 0.1 ``lr``, and a
  gradient that is rounding noise altogether (its exact value 0) steps by up to ``lr`` either way. The weights of
  such an element can differ by anything up to what Adam lets both runs move it: no AdamW step moves an element
  by more than ``lr * bound_t`` (:func:`adam_step_bound`, 1.00-1.01 for the first steps with the default betas;
  weight decay moves both runs alike), so never by more than ``2 * lr * sum_t bound_t`` between the runs.
  (ZeRO-3 against FSDP2, one step: a ``v_proj`` element with exact gradient 1.75e-8 and fp32 noise 3e-9 ends
  4.8e-5 apart, 2.4% of ``lr``; on other machines such elements ended 1.6e-4 and 2.6e-4 apart.) These
  elements are few: those whose gradient is within a few ``eps`` of 0, a fraction of about ``eps / median |g|``
  (2e-5 here: 0 to 69 of 3.5M elements beyond ``rtol`` in the ZeRO/FSDP2 comparisons, at most 0.14 of the
  per-tensor allowance); ``noisy_fraction = 1e-3`` bounds their count, per tensor (rounded up: a small tensor
  may have one) and in all.

A key projection's bias is the exception to "few": it adds ``q . b`` to every key score of a query, a constant
the softmax ignores, so its exact gradient is 0 except where RoPE rotates it differently per position, and
the slow rotary frequencies barely rotate over a short sequence (a quarter of a Qwen2 head's dimensions here).
Those elements step on rounding noise alone: tensors named in ``noise_driven`` are held to Adam's bound only.

The agreement means something only when the update dwarfs the tolerance: at least half of the trained elements
must have moved by more than 100x their tolerance (AdamW moves nearly every element by about ``lr`` a step).
Tensors that did not move in one run (frozen) must be bit-equal to ``before`` in both.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch

RTOL = 1e-3
"""Of a tensor's largest update: the two runs' disagreement on an element with an ordinary gradient."""
NOISE_DRIVEN = ("k_proj.bias",)
"""Name endings of tensors whose exact gradient is mostly 0 (see above): only Adam's bound applies to them."""
NOISY_FRACTION = 1e-3
"""Of a tensor's (and of all) elements: at most this many may differ more, up to Adam's bound."""
MOVED_BEYOND = 100.0
"""The update must exceed this many tolerances on at least half of the trained elements."""


def adam_step_bound(step: int, betas: Sequence[float] = (0.9, 0.999)) -> float:
    """The largest ``|m_hat / sqrt(v_hat)|`` at optimizer step ``step`` (1-based) over all gradient histories.

    ``m_hat = sum_i w_i g_i`` and ``v_hat = sum_i u_i g_i^2`` with the bias-corrected EMA weights ``w_i``, ``u_i``;
    Cauchy-Schwarz gives ``|m_hat| <= sqrt(sum_i w_i^2 / u_i) * sqrt(v_hat)``, reached for ``g_i ~ w_i / u_i``.
    It is 1 at step 1 (``lr * sign(g)``) and grows slowly (1.0036 at step 3 with betas 0.9, 0.999)."""
    beta1, beta2 = betas
    total = 0.0
    for i in range(1, step + 1):
        w = (1 - beta1) * beta1 ** (step - i) / (1 - beta1 ** step)
        u = (1 - beta2) * beta2 ** (step - i) / (1 - beta2 ** step)
        total += w * w / u
    return math.sqrt(total)


def adam_difference_bound(lr: float, steps: int, betas: Sequence[float] = (0.9, 0.999)) -> float:
    """The most two AdamW runs of ``steps`` steps at learning rates up to ``lr`` can move one element apart."""
    return 2 * lr * sum(adam_step_bound(t, betas) for t in range(1, steps + 1))


def _tolerance(largest_update: float, before: torch.Tensor, steps: int, rtol: float) -> torch.Tensor:
    """Per element: ``rtol`` of the tensor's largest update, plus an fp32 rounding of the weight per step in each
    run."""
    rounding = 2 * steps * torch.finfo(torch.float32).eps * before.abs()
    return rtol * largest_update + rounding


def assert_updates_agree(after_a: Mapping[str, torch.Tensor], after_b: Mapping[str, torch.Tensor],
                         before: Mapping[str, torch.Tensor], *, lr: float, steps: int,
                         betas: Sequence[float] = (0.9, 0.999), rtol: float = RTOL,
                         noisy_fraction: float = NOISY_FRACTION, noise_driven: Sequence[str] = NOISE_DRIVEN) -> None:
    """``after_a`` and ``after_b`` are the same ``steps`` AdamW steps (learning rates up to ``lr``) from ``before``,
    within the tolerance the module docstring derives; the update must be far larger than that tolerance."""
    assert after_a.keys() == after_b.keys() == before.keys()
    bound = adam_difference_bound(lr, steps, betas)
    noisy_total = moved = trained = 0
    for name, start in before.items():
        a, b, start = after_a[name].double(), after_b[name].double(), start.double()
        update, other = b - start, a - start
        if not update.any():  # frozen (or never given a gradient nor decay): no route may move it
            assert torch.equal(a, start), f"{name}: moved in one run only"
            continue
        difference = (a - b).abs()
        assert float(difference.max()) <= bound, (
            f"{name}: differs by {float(difference.max()):.2e}, more than Adam can move it ({bound:.2e})")
        if name.endswith(tuple(noise_driven)):
            continue
        tolerance = _tolerance(max(float(update.abs().max()), float(other.abs().max())), start, steps, rtol)
        noisy = int((difference > tolerance).sum())
        assert noisy <= math.ceil(noisy_fraction * update.numel()), (
            f"{name}: {noisy} of {update.numel()} elements differ by more than {rtol} of the largest update "
            f"({float(difference.max()):.2e} at most)")
        noisy_total += noisy
        moved += int((update.abs() > MOVED_BEYOND * tolerance).sum())
        trained += update.numel()
    assert trained, "nothing was trained"
    assert noisy_total <= noisy_fraction * trained, f"{noisy_total} of {trained} elements differ beyond tolerance"
    assert moved >= trained / 2, (
        f"only {moved} of {trained} trained elements moved by more than {MOVED_BEYOND:g}x their tolerance: "
        "the update is too small for the agreement to mean anything")
