"""The identity the rule kernel's exact scores rest on (csrc/preprocess/qk_rule.cu): each
estimate's smoothed scores c·Q_s K_sᵀ (``reference.qk_fp4_error``'s first and floor estimates,
``pv_p_error``'s) equal c'·(q − w)·kᵀ up to a constant per row, with q and k the raw rows, c' the
scale of the unrotated scores and w Q's options-free mean (``reference.options_free_means``; zero
for P's estimate, whose rows keep their mean). The balance's powers of two cancel in each
channel's product, the rotation scales every dot product by D/64, and K's mean adds a constant per
row, which no softmax sees. So the two give the same softmax, with and without the options, with
one Q mean or per-block means. In float64 from the reference's float32 rows, on every row of the
call (the rule samples some of them)."""

import pytest
import torch

from sageattn3 import reference as ref

import attention_cases as ac

OPTIONS = {"defaults": {}, "rotation": {"qk_rotation": True}, "balance": {"qk_balance": True},
           "balance+rotation": {"qk_balance": True, "qk_rotation": True},
           "all three": {"qk_balance": True, "qk_rotation": True, "qk_scale_search": True}}


def _row_means(mean_q: torch.Tensor, sq: int) -> torch.Tensor:
    """(B, Hq, nm, D) -> (B, Hq, sq, D): each query row's mean (its 128-row block's, or the one)."""
    idx = torch.arange(sq) // 128 if mean_q.shape[-2] > 1 else torch.zeros(sq, dtype=torch.long)
    return mean_q[..., idx, :]


def _softmax(scale: float, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.softmax(scale * a.double() @ b.double().transpose(-1, -2), dim=-1)


@pytest.mark.parametrize("options", list(OPTIONS), ids=list(OPTIONS))
@pytest.mark.parametrize("per_block_mean", [True, False])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("case", ["qk_massive", "k_sink", "rope_bias", "mixed_heads"])
def test_the_exact_scores_are_the_raw_rows_minus_the_options_free_mean(case, d, per_block_mean, options):
    q, k, v = ac.make(case, 1, 4, 2, 300, 300, d, seed=3)
    pre = ref.preprocess(q, k, v, per_block_mean=per_block_mean, **OPTIONS[options])
    hq, sq = q.shape[1], q.shape[2]
    rotated = bool(pre.qk_rotation)
    turn = ref.rotate if rotated else (lambda x: x)
    scale = d ** -0.5 / ref.rotation_score_factor(d, rotated)  # the reference's, on its rows
    raw_scale = d ** -0.5  # the unrotated scores' (the kernel's G.scale_exact)
    cq = 1.0 if pre.balance is None else ref.expand_kv(torch.exp2(-pre.balance), hq)
    ck = 1.0 if pre.balance is None else torch.exp2(pre.balance)
    k_s = ref.expand_kv(turn(k.float() * ck) - pre.mean_k.float(), hq)
    k_raw = ref.expand_kv(k, hq)
    # Q·Kᵀ's estimate (the floor's exact rows are the same: raw minus the options-free means)
    q_s = turn(q.float() * cq) - _row_means(pre.mean_q.float(), sq)
    w = _row_means(ref.options_free_means(pre)[0], sq)
    want, got = _softmax(scale, q_s, k_s), _softmax(raw_scale, q.double() - w.double(), k_raw)
    assert float((got - want).abs().max()) < 2e-5, (case, d, options)
    # P's estimate: Q's rows whole
    want_p, got_p = _softmax(scale, turn(q.float() * cq), k_s), _softmax(raw_scale, q, k_raw)
    assert float((got_p - want_p).abs().max()) < 2e-5, (case, d, options)
    # and the identity is not vacuous: without w (Q's mean kept), the first estimate's softmax differs
    assert float((_softmax(raw_scale, q, k_raw) - want).abs().max()) > 1e-3
