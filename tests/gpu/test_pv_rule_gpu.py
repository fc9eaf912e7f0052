"""The rule's FP8 P·V choice on the GPU (``pv_precision="auto"``, the default):

- P's estimate in the rule kernel (``qk_rule_select``'s P blocks) against ``reference.pv_p_error``
  on the reference's own preprocessing, plain and with every option, and the selection bits it sets
  (bit 1 of sel_q, sel_v per kv head), leaving the Q·Kᵀ choice as it was;
- V's MXFP8 quantizer with a selection (the chosen kv heads bit for bit, the others untouched);
- the public call: large logits in fp16 (every head FP8 P·V) against the reference and exact
  attention, heads of both kinds in one call (``blockscaled_attn_mixed``), and plain data bit for
  bit the NVFP4 P·V output;
- the FP8 P·V self-check, whose per-head case runs the mixed op.
Needs a CUDA device and an FP4-path wheel (the test flavour on sm_90)."""

import pytest
import torch

import attention_cases as ac
from gpu_common import same_bytes
from test_dispatch_fp4 import fp4  # noqa: F401  (the fixture)
from test_pv_fp8_gpu import _pre_to, _pv8_or_skip

FIGURES: list[str] = []


def _rule(q, k, v, pre, limit_pv, select_all=False, causal=False):
    from sageattn3 import _kernels, reference as ref

    return _kernels.qk_rule_select(q, k, v, pre, q.shape[-1] ** -0.5, ref.AUTO_ERROR_LIMIT, select_all, limit_pv,
                                   causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("seed", [3, 7, 11])
def test_p_estimate_fp16_large_logits_over_seeds(fp4, seed, d, causal):  # noqa: F811
    """fp16 large logits (P near e^-10 of the row max, below fp16's smallest normal), 2048
    tokens and three seeds: the kernel splits P into two fp16 parts only after scaling it up, so
    its P estimate stays within the reference's 2e-3 (unscaled, seed 7 at D 128 was 3.9e-3)."""
    _pv8_or_skip()
    from sageattn3 import _kernels, reference as ref

    if not _kernels.has_rule_kernel():
        pytest.skip("this wheel has no qk_rule kernel")
    q, k, v = ac.make("large_logits", 1, 4, 2, 2048, 2048, d, seed=seed)
    assert q.dtype == torch.float16
    pre_cpu = ref.preprocess(q, k, v)
    want = ref.pv_p_error(q, k, v, pre_cpu, is_causal=causal)
    err_pv = _rule(q.cuda(), k.cuda(), v.cuda(), _pre_to(pre_cpu, "cuda"), ref.PV_ERROR_LIMIT, causal=causal)[3]
    rel = float(((err_pv.cpu() - want).abs() / want.abs()).max())
    FIGURES.append(f"large_logits fp16 2048 seed={seed} D={d} causal={causal}: P estimate vs reference max rel {rel:.1e}")
    assert rel < 2e-3, (err_pv, want)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("options", [{}, {"qk_rotation": True}, {"qk_balance": True, "qk_rotation": True}])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("case, b, hq, hk, sq, sk", [("large_logits", 1, 4, 2, 1024, 1024),
                                                    ("randn", 2, 4, 1, 700, 333), ("k_sink", 1, 2, 2, 1000, 1300),
                                                    ("rope_bias", 1, 4, 2, 129, 2000),
                                                    ("large_logits", 1, 4, 2, 300, 300),
                                                    ("v_sink", 1, 4, 2, 1024, 1024), ("v_sink", 2, 4, 1, 500, 777)])
def test_p_estimate_matches_the_reference(fp4, case, b, hq, hk, sq, sk, d, options, causal):  # noqa: F811
    _pv8_or_skip()
    from sageattn3 import _kernels, reference as ref

    if not _kernels.has_rule_kernel():
        pytest.skip("this wheel has no qk_rule kernel")
    q, k, v = ac.make(case, b, hq, hk, sq, sk, d, seed=sq + d)
    pre_cpu = ref.preprocess(q, k, v, **options)
    want = ref.pv_p_error(q, k, v, pre_cpu, is_causal=causal)
    pre = _pre_to(pre_cpu, "cuda")
    q, k, v = q.cuda(), k.cuda(), v.cuda()
    err, sel_q, sel_k, err_pv, sel_v, _ = _rule(q, k, v, pre, ref.PV_ERROR_LIMIT, causal=causal)
    rel = float(((err_pv.cpu() - want).abs() / want.abs()).max())
    FIGURES.append(f"{case} D={d} {sorted(options)} causal={causal}: P estimate kernel {err_pv.flatten().tolist()} "
                   f"vs reference max rel {rel:.1e}")
    assert rel < 2e-3, (err_pv, want)
    pv8 = err_pv > ref.PV_ERROR_LIMIT
    assert torch.equal(((sel_q >> 1) & 1).bool(), pv8)
    far = (want - ref.PV_ERROR_LIMIT).abs() > 1e-3  # the reference's choice, where the two cannot straddle it
    assert torch.equal(pv8.cpu()[far], (want > ref.PV_ERROR_LIMIT)[far])
    assert torch.equal(sel_v.bool(), pv8.view(b, hk, hq // hk).any(-1))
    # the Q·Kᵀ choice is the one without P's estimate (and the mask does not touch it)
    e2, q2, k2, pv_nan, v2, _ = _rule(q, k, v, pre, -1.0, causal=not causal)
    assert torch.equal(e2, err) and torch.equal(q2, sel_q & 5) and torch.equal(k2, sel_k)
    assert bool(pv_nan.isnan().all()) and not bool(v2.any())
    if case in ac.PV_CASES:
        assert bool(pv8.any()), err_pv
    else:
        assert not bool(pv8.any()), err_pv


def test_v_quantizer_with_a_selection(fp4):  # noqa: F811
    pv8 = _pv8_or_skip()
    v = torch.randn(2, 3, 300, 128, dtype=torch.bfloat16, device="cuda")
    full_c, full_s = pv8.quant_mxfp8_cols(v, 128)
    sel = torch.tensor([[1, 0, 1], [0, 0, 1]], dtype=torch.uint8, device="cuda")
    codes, scales = pv8.quant_mxfp8_cols(v, 128, sel=sel)
    pick = sel.bool()
    assert same_bytes(codes[pick], full_c[pick]) and same_bytes(scales[pick], full_s[pick])
    with pytest.raises(ValueError, match="one byte per group"):
        pv8.quant_mxfp8_cols(v, 128, sel=sel[:1])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("case", ac.PV_CASES)
def test_pv_cases_by_default(fp4, case, d, causal):  # noqa: F811
    """The accuracy table's cases whose P·V needs MXFP8, with the defaults: large logits in fp16 (P's
    error) and attention sinks whose V is 1/30 of the others' (``v_sink``, bf16: NVFP4 V rounds the
    sinks' V to zero, NVFP4 P·V below 0.6 against exact attention; V's share of the estimate). The
    rule gives every head FP8 P·V by the kernels' own estimate (the one op); the kernels equal the
    reference (>= 0.99999) and reach >= 0.99 against exact attention."""
    _pv8_or_skip()
    from sageattn3 import reference as ref

    q, k, v = ac.make(case, 1, 4, 2, 1024, 1024, d, seed=0)
    out, choice = fp4.sageattn3_blackwell(q.cuda(), k.cuda(), v.cuda(), is_causal=causal, return_qk_choice=True)
    out = out.float().cpu()
    want = ref.sageattn3(q, k, v, is_causal=causal)
    exact = ref.exact_attention(q, k, v, is_causal=causal)
    c_ref, c_exact = ac.cos_sim(out, want), ac.cos_sim(out, exact)
    fig = (f"{case} {str(q.dtype)[6:]} D={d} causal={causal}, defaults: kernel vs reference {c_ref:.7f}, "
           f"vs exact {c_exact:.5f}")
    if case == "v_sink":
        fp4_pv = fp4.sageattn3_blackwell(q.cuda(), k.cuda(), v.cuda(), is_causal=causal, pv_precision="fp4")
        c_fp4 = ac.cos_sim(fp4_pv.float().cpu(), exact)
        fig += f" (NVFP4 P·V {c_fp4:.4f})"
        assert c_fp4 < 0.6, fig
    FIGURES.append(f"{fig}; {choice.describe()}")
    assert bool(choice.pv_fp8.all()), choice.describe()
    assert c_ref >= 0.99999 and c_exact >= 0.99


def test_causal_call_takes_the_masked_estimate(fp4):  # noqa: F811
    """Large logits, seed 6, D 64, causal: one head's unmasked estimate is 0.097 (NVFP4 P·V, cos 0.9685
    against exact attention), its masked one 0.191. The causal call gives every head FP8 P·V, as the
    reference does, and every head reaches cos 0.98; the same inputs without the mask keep that head
    on NVFP4, as the reference's choice does."""
    _pv8_or_skip()
    from sageattn3 import reference as ref

    q, k, v = ac.make("large_logits", 1, 4, 2, 1024, 1024, 64, seed=6)
    for causal in (True, False):
        out, choice = fp4.sageattn3_blackwell(q.cuda(), k.cuda(), v.cuda(), is_causal=causal, return_qk_choice=True)
        want_sel = ref.preprocess(q, k, v, qk_precision="auto", is_causal=causal).pv_fp8
        assert torch.equal(choice.pv_fp8.cpu(), want_sel), choice.describe()
        out = out.float().cpu()
        want = ref.sageattn3(q, k, v, is_causal=causal)
        heads = [ac.cos_sim(out[:, h], ref.exact_attention(q, k, v, is_causal=causal)[:, h]) for h in range(4)]
        c_ref = ac.cos_sim(out, want)
        FIGURES.append(f"large_logits seed 6 D=64 causal={causal}: {choice.describe()}; kernel vs reference "
                       f"{c_ref:.7f}, per head vs exact {[round(c, 4) for c in heads]}")
        assert c_ref >= 0.99999
        if causal:
            assert bool(choice.pv_fp8.all()) and min(heads) >= 0.98, heads
        else:
            assert choice.pv_fp8.tolist() == [[True, True, False, True]]


@pytest.mark.parametrize("qk", ["auto", "fp8"])
@pytest.mark.parametrize("causal", [False, True])
def test_heads_of_both_kinds_in_one_call(fp4, causal, qk):  # noqa: F811
    """kv head 0 large logits (its two q heads FP8 P·V), kv head 1 zero-mean (NVFP4 P·V): one call
    through blockscaled_attn_mixed equals the reference per head (>= 0.99999), and the zero-mean
    heads equal the NVFP4 P·V call's bytes."""
    _pv8_or_skip()
    from sageattn3 import reference as ref

    a = ac.make("large_logits", 1, 2, 1, 777, 1000, 128, seed=1)
    z = ac.make("randn", 1, 2, 1, 777, 1000, 128, seed=1, dtype=torch.float16)
    q, k, v = (torch.cat((x, y), dim=1) for x, y in zip(a, z))
    out, choice = fp4.sageattn3_blackwell(q.cuda(), k.cuda(), v.cuda(), is_causal=causal, qk_precision=qk,
                                          return_qk_choice=True)
    assert choice.pv_fp8.tolist() == [[True, True, False, False]], choice.describe()
    want = ref.sageattn3(q, k, v, is_causal=causal, qk_precision=qk)
    for h in range(4):
        c = ac.cos_sim(out[:, h].float().cpu(), want[:, h])
        FIGURES.append(f"both kinds qk={qk} causal={causal} head {h}: kernel vs reference {c:.7f}")
        assert c >= 0.99999, (h, c)
    fp4_only = fp4.sageattn3_blackwell(q.cuda(), k.cuda(), v.cuda(), is_causal=causal, qk_precision=qk,
                                       pv_precision="fp4")
    assert same_bytes(out[:, 2:].contiguous(), fp4_only[:, 2:].contiguous())


@pytest.mark.parametrize("case", ["randn", "mixed_heads", "rope_bias"])
def test_plain_data_keeps_the_fp4_output(fp4, case):  # noqa: F811
    """Where no head needs FP8 P·V the default call's output is the NVFP4 P·V call's, byte for byte."""
    _pv8_or_skip()
    q, k, v = (t.cuda() for t in ac.make(case, 1, 4, 2, 600, 600, 128, seed=7))
    out = fp4.sageattn3_blackwell(q, k, v)
    assert same_bytes(out, fp4.sageattn3_blackwell(q, k, v, pv_precision="fp4"))


def test_the_mixed_op_refuses_a_missing_selection(fp4):  # noqa: F811
    pv8 = _pv8_or_skip()
    from sageattn3 import reference as ref

    q, k, v = ac.make("randn", 1, 2, 1, 256, 256, 64, seed=3)
    g = _pre_to(ref.preprocess(q, k, v, pv_precision="fp8"), "cuda")
    with pytest.raises(ValueError, match="needs head_sel"):
        pv8.attention_pv8(g, g.v8, g.v8_scales, by_head=True)


def test_pv8_self_check_covers_the_mixed_op(fp4):  # noqa: F811
    _pv8_or_skip()
    from sageattn3 import _selfcheck, api

    assert any(c[8].get("pv_precision") == "auto" for c in _selfcheck.PV8_CASES)
    r = _selfcheck.run(torch.device("cuda", torch.cuda.current_device()), api._fp4_attention, _selfcheck.PV8_CASES)
    assert r.ok and len(r.figures) == len(_selfcheck.PV8_CASES), r.summary()
    FIGURES.append(f"FP8 P·V self-check: {r.summary()}")


def test_figures(capsys):
    with capsys.disabled():
        print("\n" + "\n".join(FIGURES))
