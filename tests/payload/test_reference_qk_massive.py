"""Massive outliers shared by Q and K (tests/attention_cases.py ``qk_massive``) at D 64: where the
defaults fall short of cos-sim 0.98, and why (docs/accuracy-auto.md, "Massive shared outliers").

Every head takes FP8 Q·Kᵀ on rotated rows there, and P·V stays NVFP4. The error is in Q·Kᵀ:
  - with the scores exact (float32 products of the inputs) and the defaults' NVFP4 P·V, every head
    reaches 0.9949 or more;
  - with the defaults' FP8 scores and P·V exact (float64), the worst heads stay at 0.973-0.984.
So FP8 P·V does not close the gap (it adds about 0.004); a Q·Kᵀ more precise than MXFP8 for such
heads would. That is not built, and the gap is kept measured here: the strict xfails turn into
failures once it closes. All on the CPU reference, which the kernels follow (tests/gpu)."""

from __future__ import annotations

import math

import pytest
import torch

from sageattn3 import reference as ref

import attention_cases as ac

SEQ, HQ, HK, D = 1024, 4, 2, 64
SHORT_SEEDS = (3, 7, 10)  # D 64, non-causal, bf16: the defaults at 0.9723-0.9793 (seeds 0-11: 5 of 12 below 0.98)


C = ref.LOG2E / math.sqrt(D)  # the softmax scale in the exp2 domain (FP8 rows keep the unrotated units)


def _rows(seed: int, causal: bool = False):
    """q, k, v of the case and what the defaults multiply: Qd, Kd (every head FP8 Q·Kᵀ on rotated
    rows), Vd (NVFP4 P·V's V) and delta_s per query row and key."""
    q, k, v = ac.make("qk_massive", 1, HQ, HK, SEQ, SEQ, D, seed=seed)
    pre = ref.preprocess(q, k, v, is_causal=causal, qk_precision="auto")
    assert bool(pre.qk_fp8.all()) and not bool(pre.pv_fp8.any()), "every head FP8 Q·Kᵀ, NVFP4 P·V"
    return (q, k, v, *ref._dequantized(pre, HQ), ref.attention._delta_rows(pre, SEQ))


def _per_head(seed: int, causal: bool = False) -> dict[str, list[float]]:
    """Per q head cos-sim against exact attention: the defaults; exact scores with the defaults'
    NVFP4 P·V; the defaults' scores with exact P·V."""
    q, k, v, qd, kd, vd, delta = _rows(seed, causal)
    exact = ref.exact_attention(q, k, v, is_causal=causal)
    keys = torch.nn.functional.pad(ref.expand_kv(k.float(), HQ), (0, 0, 0, vd.shape[-2] - SEQ))
    exact_scores = ref._tiled_attention(q.float(), keys, vd, torch.zeros_like(delta), SEQ, causal, C, 128)
    t = (qd @ kd.transpose(-1, -2) + delta)[..., :SEQ].double() * (C * math.log(2))
    if causal:
        t = t.masked_fill(~torch.ones(SEQ, SEQ, dtype=torch.bool).tril(), float("-inf"))
    exact_pv = torch.softmax(t, dim=-1) @ ref.expand_kv(v.double(), HQ)
    outs = {"defaults": ref.sageattn3(q, k, v, is_causal=causal), "exact Q·Kᵀ": exact_scores, "exact P·V": exact_pv}
    return {n: [ac.cos_sim(o[:, h], exact[:, h]) for h in range(HQ)] for n, o in outs.items()}


@pytest.mark.parametrize("seed", (7, 10))
def test_the_loss_is_the_fp8_scores(seed):
    cos = _per_head(seed)
    fig = {n: [round(x, 4) for x in c] for n, c in cos.items()}
    assert min(cos["defaults"]) < 0.98, fig
    assert min(cos["exact Q·Kᵀ"]) >= 0.99, fig  # NVFP4 P·V costs these heads under 0.005
    assert min(cos["exact P·V"]) < 0.98, fig     # exact P·V does not lift them to the target


def test_the_default_rows_are_what_the_loss_is_measured_on():
    """The decomposition's own check: the defaults' scores with the defaults' P·V give the defaults."""
    q, k, v, qd, kd, vd, delta = _rows(7)
    assert torch.equal(ref._tiled_attention(qd, kd, vd, delta, SEQ, False, C, 128), ref.sageattn3(q, k, v))


@pytest.mark.xfail(strict=True, reason="massive shared outliers at D 64: MXFP8 Q·Kᵀ is not precise enough "
                                       "(docs/accuracy-auto.md); a more precise Q·Kᵀ rung is not built")
@pytest.mark.parametrize("seed", SHORT_SEEDS)
def test_the_defaults_reach_the_target_on_massive_outliers(seed):
    q, k, v = ac.make("qk_massive", 1, HQ, HK, SEQ, SEQ, D, seed=seed)
    assert ac.cos_sim(ref.sageattn3(q, k, v), ref.exact_attention(q, k, v)) >= 0.98
