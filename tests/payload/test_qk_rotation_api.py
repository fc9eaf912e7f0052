"""The qk_rotation keyword through the public API on CPU: off by default, passed to the FP4 path
(a stand-in computing the reference), honoured by preprocess."""

import torch

import sageattn3
from sageattn3 import _selfcheck, api
from sageattn3 import reference as ref

import attention_cases as ac


def test_default_is_off_and_documented():
    assert ref.QK_ROTATION_DEFAULT is False
    q, k, v = ac.make("q_outliers", 1, 2, 1, 64, 64, 128, seed=1)
    assert sageattn3.preprocess(q, k, v).qk_rotation is False
    pre = sageattn3.preprocess(q, k, v, qk_rotation=True)
    assert pre.qk_rotation is True
    want = ref.preprocess(q, k, v, qk_rotation=True)
    assert torch.equal(pre.q_packed, want.q_packed) and torch.equal(pre.k_packed, want.k_packed)


def test_keyword_reaches_the_fp4_path(monkeypatch):
    seen, balanced, searched = [], [], []

    def kernel(q, k, v, is_causal, per_block_mean, sm_scale=None, qk_rotation=ref.QK_ROTATION_DEFAULT,
               qk_balance=ref.QK_BALANCE_DEFAULT, qk_scale_search=False, qk_precision="fp4", choice=None,
               pv_precision="fp4"):
        seen.append(qk_rotation)
        balanced.append(qk_balance)
        searched.append(qk_scale_search)
        return ref.sageattn3(q, k, v, is_causal=is_causal, per_block_mean=per_block_mean, sm_scale=sm_scale,
                             qk_rotation=qk_rotation, qk_balance=qk_balance,
                             qk_scale_search=qk_scale_search).to(q.dtype)

    monkeypatch.setattr(api, "_attention_path", lambda device, head_dim=None: api.AttentionPath.fp4((12, 0)))
    monkeypatch.setattr(api, "_fp4_attention", kernel)
    monkeypatch.setenv(_selfcheck.SKIP_ENV, "1")
    _selfcheck.reset()
    try:
        q, k, v = ac.make("q_outliers", 1, 2, 1, 100, 100, 128, seed=2)
        plain = sageattn3.sageattn3_blackwell(q, k, v)
        rotated = sageattn3.sageattn3_blackwell(q, k, v, qk_rotation=True)
        assert seen == [False, True]
        assert torch.equal(rotated, ref.sageattn3(q, k, v, qk_rotation=True).to(q.dtype))
        bal = sageattn3.sageattn3_blackwell(q, k, v, qk_balance=True)
        assert balanced == [False, False, True]
        assert torch.equal(bal, ref.sageattn3(q, k, v, qk_balance=True).to(q.dtype))
        # (with "auto" both give every head FP8 here, and FP8 of rows scaled by powers of two is the
        # same, so bal == plain: the balance shows in FP4 Q·Kᵀ)
        assert not torch.equal(ref.sageattn3(q, k, v, qk_balance=True, qk_precision="fp4"),
                               ref.sageattn3(q, k, v, qk_precision="fp4"))
        # (with "auto" every head is FP8 on rotated rows here, with or without qk_rotation: the
        # keyword shows in `seen`, and in FP4 Q·Kᵀ)
        assert torch.equal(plain, ref.sageattn3(q, k, v).to(q.dtype))
        assert not torch.equal(ref.sageattn3(q, k, v, qk_rotation=True, qk_precision="fp4"),
                               ref.sageattn3(q, k, v, qk_precision="fp4"))
        # the scale search: the keyword, else the module default (or the rotation), reaches the FP4 path as a bool
        both = sageattn3.sageattn3_blackwell(q, k, v, qk_balance=True, qk_rotation=True, qk_scale_search=True)
        assert torch.equal(both, ref.sageattn3(q, k, v, qk_balance=True, qk_rotation=True,
                                               qk_scale_search=True).to(q.dtype))
        monkeypatch.setattr(ref, "QK_SCALE_SEARCH", 1)
        sageattn3.sageattn3_blackwell(q, k, v)
        sageattn3.sageattn3_blackwell(q, k, v, qk_scale_search=False)
        assert searched == [False, True, False, True, True, False]  # the rotation brought it (second call)
        assert all(type(x) is bool for x in searched)
    finally:
        _selfcheck.reset()
