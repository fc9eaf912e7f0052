"""sageattn3_blackwell on a GPU without the FP4 path (e.g. an H100): SDPA with one warning."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from gpu_common import sageattn3_or_skip


def test_backend_names_the_reason(monkeypatch):
    sa = sageattn3_or_skip()
    monkeypatch.delenv("SAGEATTN3_FORCE_FP4", raising=False)  # the reason without the test opt-in
    cc = torch.cuda.get_device_capability()
    b = sa.backend()
    if cc in ((12, 0), (12, 1)):
        assert b.startswith("fp4-sm12") or "attention kernel" in b or "no code" in b
    else:
        assert b == f"sdpa: sm_{cc[0]}{cc[1]} has no FP4 MMA (the FP4 path needs sm_120/sm_121)"
        assert sa.is_available() is False
    assert sa.backend("cpu") == "sdpa: CPU tensors"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hq,hk,s,d", [(8, 8, 333, 128), (8, 2, 1024, 64), (4, 1, 1, 64)])
def test_fallback_matches_sdpa(dtype, causal, hq, hk, s, d):
    sa = sageattn3_or_skip()
    if sa.is_available():
        pytest.skip("this GPU takes the FP4 path")
    from sageattn3 import api

    api._warned.clear()
    q = torch.randn(2, hq, s, d, dtype=dtype, device="cuda")
    k = torch.randn(2, hk, s, d, dtype=dtype, device="cuda")
    v = torch.randn(2, hk, s, d, dtype=dtype, device="cuda")
    copies = [t.clone() for t in (q, k, v)]
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = sa.sageattn3_blackwell(q, k, v, is_causal=causal)
        sa.sageattn3_blackwell(q, k, v, is_causal=causal)
    msgs = [str(x.message) for x in w if "sageattn3" in str(x.message)]
    assert len(msgs) == 1 and "falling back" in msgs[0]
    rep = hq // hk
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=causal)
    assert out.dtype == dtype and out.shape == q.shape
    assert torch.allclose(out, want, atol=2e-3, rtol=0)
    for t, c in zip((q, k, v), copies):
        assert torch.equal(t, c)


def test_validation_on_cuda():
    sa = sageattn3_or_skip()
    q = torch.randn(1, 2, 8, 64, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="k is on cpu"):
        sa.sageattn3_blackwell(q, q.cpu(), q)
    with pytest.raises(TypeError, match="q must be one of"):
        sa.sageattn3_blackwell(q.float(), q, q)
    with pytest.raises(NotImplementedError, match="attn_mask"):
        sa.sageattn3_blackwell(q, q, q, attn_mask=torch.ones(8, 8, device="cuda", dtype=torch.bool))


def test_reference_attention_runs_on_gpu():
    sageattn3_or_skip()
    from sageattn3 import reference as ref

    g = torch.Generator().manual_seed(0)
    q = (torch.randn(1, 2, 300, 128, generator=g) + torch.randn(128, generator=g)).bfloat16().cuda()
    k = (torch.randn(1, 2, 300, 128, generator=g) + 3 * torch.randn(128, generator=g)).bfloat16().cuda()
    v = (torch.randn(1, 2, 300, 128, generator=g) + 2 * torch.randn(128, generator=g)).bfloat16().cuda()
    out = ref.sageattn3(q, k, v, is_causal=True)
    assert ref.cosine_similarity(out, ref.exact_attention(q, k, v, is_causal=True)) >= 0.99
