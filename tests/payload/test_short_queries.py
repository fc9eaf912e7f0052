"""Short queries ("auto" on calls of 2 to 127 query rows gives every head FP8 Q·Kᵀ:
``reference.rule_limit``, ``AUTO_SHORT_QUERY_ROWS``): the limit, the reference's choice, and
accuracy against float64 exact attention on heads the rule's estimate used to miss there
(tests/bench/short_queries.py has the study). The one op's and the separate ops' limit:
tests/payload/test_call_decisions.py."""

from __future__ import annotations

import pytest
import torch

import attention_cases as ac
from sageattn3 import reference as ref


def test_the_rule_limit_by_query_rows(monkeypatch):
    assert ref.AUTO_SHORT_QUERY_ROWS == ref.Q_MEAN_BLOCK == 128
    for sq in (2, 3, 8, 64, 127):
        assert ref.rule_limit(sq) == -1.0, sq
    for sq in (1, 128, 129, 1000):
        assert ref.rule_limit(sq) == ref.AUTO_ERROR_LIMIT, sq
    monkeypatch.setattr(ref, "AUTO_ERROR_LIMIT", 0.3)  # both knobs are read per call
    monkeypatch.setattr(ref, "AUTO_SHORT_QUERY_ROWS", 16)
    assert [ref.rule_limit(sq) for sq in (1, 2, 15, 16, 64)] == [0.3, -1.0, -1.0, 0.3, 0.3]


@pytest.mark.parametrize("sq", [1, 8, 127, 128])
def test_short_queries_take_fp8_on_every_head(sq):
    """Easy data (zero-mean): 2 to 127 query rows send every head to FP8 Q·Kᵀ; one row and a full
    128-row block keep FP4 where the estimate is below the limit. A NaN estimate keeps FP4."""
    q, k, v = ac.make("randn", 1, 4, 2, sq, 512, 64, seed=1)
    pre = ref.preprocess(q, k, v, qk_precision="auto")
    if 1 < sq < 128:
        assert pre.qk_fp8.all(), pre.qk_error
    else:
        assert torch.equal(pre.qk_fp8, pre.qk_error > ref.AUTO_ERROR_LIMIT) and not pre.qk_fp8.any(), pre.qk_error
    nan = torch.tensor([[float("nan"), 0.0]])
    assert ref.choose_qk_precision("auto", nan, ref.rule_limit(8)).tolist() == [[False, True]]


# (case, sq, sk, D, seed): heads whose FP4 Q·Kᵀ the rule's estimate missed (estimate below the
# limit, or near 0) and which it left far below 0.98
MISSED = [("qk_outliers", 8, 2048, 128, 5), ("qk_massive", 8, 2048, 64, 3), ("qk_massive", 2, 4096, 64, 0)]


@pytest.mark.parametrize("case,sq,sk,d,seed", MISSED)
def test_short_queries_reach_the_target_with_the_defaults(monkeypatch, case, sq, sk, d, seed):
    q, k, v = ac.make(case, 1, 4, 2, sq, sk, d, seed=seed)
    exact = ref.exact_attention(q, k, v)
    cos = lambda out: [ac.cos_sim(out[:, h], exact[:, h]) for h in range(4)]  # noqa: E731
    now = cos(ref.sageattn3(q, k, v))
    assert min(now) >= 0.98, now
    monkeypatch.setattr(ref, "AUTO_SHORT_QUERY_ROWS", 0)  # the rule's limit on every call: before
    est = ref.qk_fp4_error(q, k, v, ref.preprocess(q, k, v, qk_precision="fp4"))[0]
    before = cos(ref.sageattn3(q, k, v))
    missed = [h for h in range(4) if est[h] <= ref.AUTO_ERROR_LIMIT and before[h] < 0.9]
    assert missed, (est, before)
