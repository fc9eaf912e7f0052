"""The per-head Q·Kᵀ precision on the GPU (the installed wheel; an H100 runs the MMA-model test
flavour, whose FP8 MMA is the software model of attn/fp4_mma.cuh):

- the MXFP8 quantization kernel bit for bit against ``reference.quantize_mxfp8_rows``;
- the attention kernel with FP8 heads against ``reference.sageattn3`` on the reference's own
  preprocessing (cos-sim >= 0.99999) and end to end against exact attention (the issue's targets);
- "auto" on data where no head needs help: the FP4 output bit for bit;
- the rule's decisions on the device, under CUDA graph capture and torch.compile."""

from __future__ import annotations

import pytest
import torch

import attention_cases as ac
from attn_common import reference_selection
from test_dispatch_fp4 import fp4  # noqa: F401  (the fixture)

FIGURES: list[str] = []


def _pre_to(pre, device):
    import dataclasses

    return dataclasses.replace(pre, **{f.name: getattr(pre, f.name).to(device) for f in dataclasses.fields(pre)
                                       if isinstance(getattr(pre, f.name), torch.Tensor)})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("balance", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_mxfp8_quantization_is_bit_exact(fp4, dtype, balance, d):  # noqa: F811
    from sageattn3 import _kernels, reference as ref

    q, k, v = ac.make("k_outliers", 2, 4, 2, 300, 200, d, seed=5, dtype=dtype)
    qc, kc, vc = q.cuda(), k.cuda(), v.cuda()
    pre = fp4.preprocess(qc, kc, vc, qk_balance=balance)
    assert (pre.balance is not None) == balance
    sel_q = torch.tensor([[1, 0, 1, 1], [0, 1, 1, 0]], dtype=torch.uint8, device="cuda")
    q8, q8s = _kernels.mxfp8_smooth_quant(qc, pre.mean_q, pre.balance, -1, sel_q, 128)
    k8, k8s = _kernels.mxfp8_smooth_quant(kc, pre.mean_k, pre.balance, 1, None, 128)
    cq = 1.0 if pre.balance is None else ref.expand_kv(torch.exp2(-pre.balance), 4)
    ck = 1.0 if pre.balance is None else torch.exp2(pre.balance)
    qs = ref.smooth_q(qc.float() * cq, pre.mean_q)
    ks = kc.float() * ck - pre.mean_k
    wq, wqs = ref.quantize_mxfp8_rows(ref.pad_dim(qs, -2, 128).cpu())
    wk, wks = ref.quantize_mxfp8_rows(ref.pad_dim(ks, -2, 128).cpu())
    sel = sel_q.bool().cpu()
    assert torch.equal(q8.view(torch.uint8).cpu()[sel], wq.view(torch.uint8)[sel])
    assert torch.equal(q8s.cpu()[sel], wqs[sel])
    assert torch.equal(k8.view(torch.uint8).cpu(), wk.view(torch.uint8)) and torch.equal(k8s.cpu(), wks)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("balance", [False, True])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("pre_rotated", [True, False])
def test_rotated_mxfp8_quantization_is_bit_exact(fp4, dtype, balance, d, pre_rotated):  # noqa: F811
    """FP8 Q·Kᵀ's rows, rotated, bit for bit against the reference on the kernels' own means
    (ragged lengths, GQA, three mean rows of Q; padding rows zero codes and scale byte 1); the
    paired op the same; bad arguments refused.
    - pre_rotated (qk_rotation): the balanced rows rotated, then the (rotated) mean subtracted
      (rotate=1);
    - not (the defaults): rotate=2 rotates the (unrotated) means in the kernel too, and Q's rows
      are then times 64/D (``reference.fp8_rows``)."""
    from sageattn3 import _kernels, reference as ref

    q, k, v = ac.make("qk_massive", 2, 4, 2, 300, 200, d, seed=7, dtype=dtype)
    qc, kc, vc = q.cuda(), k.cuda(), v.cuda()
    pre = fp4.preprocess(qc, kc, vc, qk_rotation=pre_rotated, qk_balance=balance)
    assert pre.qk_rotation == pre_rotated and (pre.balance is not None) == balance
    sel_q = torch.tensor([[1, 1, 0, 1], [1, 0, 1, 1]], dtype=torch.uint8, device="cuda")
    mode = {"rotate": 1} if pre_rotated else {"rotate": 2, "row_scale": 64.0 / d}
    q8, q8s = _kernels.mxfp8_smooth_quant(qc, pre.mean_q, pre.balance, -1, sel_q, 128, **mode)
    k8, k8s = _kernels.mxfp8_smooth_quant(kc, pre.mean_k, pre.balance, 1, None, 128, rotate=mode["rotate"])
    bal = None if pre.balance is None else pre.balance.cpu()
    cq = 1.0 if bal is None else ref.expand_kv(torch.exp2(-bal), 4)
    ck = 1.0 if bal is None else torch.exp2(bal)
    if pre_rotated:
        qs = ref.smooth_q(ref.rotate(q.float() * cq), pre.mean_q.cpu())
        ks = ref.rotate(k.float() * ck) - pre.mean_k.cpu()
    else:
        qs, ks = ref.fp8_rows(q.float() * cq, pre.mean_q.cpu(), k.float() * ck, pre.mean_k.cpu())
    wq, wqs = ref.quantize_mxfp8_rows(ref.pad_dim(qs, -2, 128))
    wk, wks = ref.quantize_mxfp8_rows(ref.pad_dim(ks, -2, 128))
    sel = sel_q.bool().cpu()
    assert torch.equal(q8.view(torch.uint8).cpu()[sel], wq.view(torch.uint8)[sel])
    assert torch.equal(q8s.cpu()[sel], wqs[sel])
    assert torch.equal(k8.view(torch.uint8).cpu(), wk.view(torch.uint8)) and torch.equal(k8s.cpu(), wks)
    assert int(k8s[:, :, 200:].min()) == int(k8s[:, :, 200:].max()) == 1  # padding rows
    ones_q, ones_k = torch.ones_like(sel_q), torch.ones((2, 2), dtype=torch.uint8, device="cuda")
    pq, pqs, pk, pks = _kernels.mxfp8_smooth_quant_qk(qc, kc, pre, ones_q, ones_k, 128)  # rotate 1 or 2, as pre is
    if d == 64:  # the 16-bit Q·Kᵀ rows: the same values in bf16, bit for bit, and no scales
        wq, wk = (ref.qk16_rows(ref.pad_dim(x, -2, 128)) for x in (qs, ks))
        assert pq.shape == (2, 4, 384, 128) and pqs.numel() == 0 and pks.numel() == 0
        assert torch.equal(pq.cpu(), wq.view(torch.uint8)) and torch.equal(pk.cpu(), wk.view(torch.uint8))
        assert int(pk[:, :, 200:].count_nonzero()) == 0  # the kernel's padding rows: +0 bytes
        bq, _ = _kernels.mxfp8_smooth_quant(qc, pre.mean_q, pre.balance, -1, sel_q, 128, bf16=True, **mode)
        assert torch.equal(bq.cpu()[sel].view(torch.uint8), wq.view(torch.uint8)[sel])
        assert torch.equal(ref.dequantize_qk_rows(pq.cpu(), pqs.cpu()), wq.float())  # the op's form read back
        # the unrotated bf16 rows (rotate=0: the smoothed rows as they are)
        bp, bps = _kernels.mxfp8_smooth_quant(kc, pre.mean_k, pre.balance, 1, None, 128, bf16=True)
        plain = ref.qk16_rows(ref.pad_dim(k.float() * ck - pre.mean_k.cpu(), -2, 128))
        assert bps.numel() == 0 and torch.equal(bp.cpu().view(torch.uint8), plain.view(torch.uint8))
    else:
        assert torch.equal(pq.cpu(), wq.view(torch.uint8)) and torch.equal(pk.cpu(), wk.view(torch.uint8))
        assert torch.equal(pqs.cpu(), wqs) and torch.equal(pks.cpu(), wks)
    with pytest.raises(RuntimeError, match="rotates rows of head dim 64 or 128"):
        x = torch.zeros(1, 1, 64, 96, dtype=dtype, device="cuda")
        _kernels.mxfp8_smooth_quant(x, torch.zeros(1, 1, 1, 96, device="cuda"), None, 1, None, 128, rotate=True)
    for bad, match in (({"rotate": 3}, "rotate must be 0, 1 or 2"), ({"rotate": 2, "row_scale": 0.3}, "power of two"),
                       ({"rotate": 1, "row_scale": 0.5}, "1 unless rotate is 2")):
        with pytest.raises(RuntimeError, match=match):
            _kernels.mxfp8_smooth_quant(kc, pre.mean_k, None, 1, None, 128, **bad)


@pytest.mark.parametrize("case", ["qk_massive", "rope_bias", "randn"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_fp8_with_the_rotation_matches_the_reference(fp4, case, causal, d):  # noqa: F811
    """qk_precision="fp8" with qk_rotation: every head's Q·Kᵀ in FP8 on the rotated rows. The
    attention kernel on the reference's own preprocessing (>= 0.99999), and the whole call end to
    end against the reference (>= 0.9999: the means are summed in another order) and exact
    attention."""
    from sageattn3 import _attn, reference as ref

    q, k, v = ac.make(case, 1, 4, 2, 700, 700, d, seed=9)
    pre = ref.preprocess(q, k, v, qk_precision="fp8", qk_rotation=True, qk_balance=True)
    want = ref.sageattn3(q, k, v, is_causal=causal, qk_precision="fp8", qk_rotation=True, qk_balance=True)
    g = _pre_to(pre, "cuda")
    got = _attn.attention_qk8(g, q8=g.q8, q8_scales=g.q8_scales, k8=g.k8, k8_scales=g.k8_scales, is_causal=causal,
                              **reference_selection(g)).float().cpu()
    c = ac.cos_sim(got, want)
    out, choice = fp4.sageattn3_blackwell(q.cuda(), k.cuda(), v.cuda(), is_causal=causal, qk_precision="fp8",
                                          qk_rotation=True, qk_balance=True, return_qk_choice=True)
    assert bool(choice.fp8.all()), choice.describe()
    c_end = ac.cos_sim(out.float().cpu(), want)
    exact = ref.exact_attention(q, k, v, is_causal=causal)
    c_exact = ac.cos_sim(out.float().cpu(), exact)
    c_rot = ac.cos_sim(fp4.sageattn3_blackwell(q.cuda(), k.cuda(), v.cuda(), is_causal=causal, qk_rotation=True,
                                               qk_balance=True, qk_precision="fp4").float().cpu(), exact)
    fig = (f"{case} D={d} causal={causal} fp8+rotation+balance: kernel vs reference cos={c:.7f}, whole call "
           f"{c_end:.6f}; vs exact {c_exact:.4f} (rotation+balance, FP4: {c_rot:.4f})")
    FIGURES.append(fig)
    assert c >= 0.99999 and c_end >= 0.9999, fig


@pytest.mark.parametrize("balance", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_auto_with_the_rotation_matches_the_reference(fp4, balance, causal, d):  # noqa: F811
    """"auto" with qk_rotation: the rule on the rotated rows picks some heads (mixed_heads: the
    RoPE'd and near-one-hot ones), which run FP8 on the rotated rows, the others FP4, in one call.
    The kernel's choice is the reference's; the attention kernel on the reference's preprocessing
    and selection >= 0.99999; the whole call against the reference >= 0.9999 and against exact
    attention no worse than "fp4" with the same options."""
    from sageattn3 import _attn, reference as ref

    q, k, v = ac.make("mixed_heads", 1, 8, 4, 700, 700, d, seed=11)
    kw = {"qk_rotation": True, "qk_balance": balance}
    pre = ref.preprocess(q, k, v, qk_precision="auto", **kw)
    assert pre.qk_fp8.any() and not pre.qk_fp8.all(), pre.qk_error
    want = ref.sageattn3(q, k, v, is_causal=causal, **kw)
    g = _pre_to(pre, "cuda")
    got = _attn.attention_qk8(g, q8=g.q8, q8_scales=g.q8_scales, k8=g.k8, k8_scales=g.k8_scales, is_causal=causal,
                              **reference_selection(g)).float().cpu()
    c = ac.cos_sim(got, want)
    out, choice = fp4.sageattn3_blackwell(q.cuda(), k.cuda(), v.cuda(), is_causal=causal, return_qk_choice=True, **kw)
    assert torch.equal(choice.fp8.cpu(), pre.qk_fp8), (choice.describe(), pre.qk_error)
    c_end = ac.cos_sim(out.float().cpu(), want)
    exact = ref.exact_attention(q, k, v, is_causal=causal)
    c_exact = ac.cos_sim(out.float().cpu(), exact)
    c_fp4 = ac.cos_sim(fp4.sageattn3_blackwell(q.cuda(), k.cuda(), v.cuda(), is_causal=causal, qk_precision="fp4",
                                               **kw).float().cpu(), exact)
    fig = (f"mixed_heads D={d} causal={causal} auto+rotation balance={balance}: fp8 heads "
           f"{int(pre.qk_fp8.sum())}/8, kernel vs reference cos={c:.7f}, whole call {c_end:.6f}; vs exact "
           f"{c_exact:.4f} (fp4 with the same options: {c_fp4:.4f})")
    FIGURES.append(fig)
    assert c >= 0.99999 and c_end >= 0.9999 and c_exact >= c_fp4, fig


@pytest.mark.parametrize("balance", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_paired_mxfp8_op_matches_two_single_ops(fp4, balance, d):  # noqa: F811
    """mxfp8_smooth_quant_qk (Q and K in one op that allocates them) gives the selected heads' rows
    of the two single-operand ops bit for bit (rows rotated there: ``pre`` is not), ragged
    lengths and GQA."""
    from sageattn3 import _kernels

    q, k, v = (t.cuda() for t in ac.make("q_outliers", 2, 4, 2, 300, 200, d, seed=6))
    pre = fp4.preprocess(q, k, v, qk_balance=balance)
    sel_q = torch.tensor([[1, 0, 0, 0], [0, 1, 1, 0]], dtype=torch.uint8, device="cuda")
    sel_k = torch.tensor([[1, 0], [1, 1]], dtype=torch.uint8, device="cuda")
    q8, q8s, k8, k8s = _kernels.mxfp8_smooth_quant_qk(q, k, pre, sel_q, sel_k, 128)
    fake = _kernels._mxfp8_smooth_quant_qk_fake(q, k, None, None, None, None, None, 128, False)
    assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in (q8, q8s, k8, k8s)]
    bf16 = d == 64  # the 16-bit Q·Kᵀ rows at D 64
    wq, wqs = _kernels.mxfp8_smooth_quant(q, pre.mean_q, pre.balance, -1, sel_q, 128, rotate=2, row_scale=64.0 / d,
                                          bf16=bf16)
    wk, wks = _kernels.mxfp8_smooth_quant(k, pre.mean_k, pre.balance, 1, sel_k, 128, rotate=2, bf16=bf16)
    row, sf = (2 * d, 0) if bf16 else (d, d // 32)
    assert q8.shape == (2, 4, 384, row) and k8.shape == (2, 2, 256, row) and q8s.shape == (2, 4, 384, sf)
    sq, sk = sel_q.bool(), sel_k.bool()
    assert torch.equal(q8[sq], wq.contiguous().view(torch.uint8)[sq]) and torch.equal(q8s[sq], wqs[sq])
    assert torch.equal(k8[sk], wk.contiguous().view(torch.uint8)[sk]) and torch.equal(k8s[sk], wks[sk])


@pytest.mark.parametrize("case", ["mixed_heads", "rope_bias", "peaky", "randn"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_fp8_kernel_matches_the_reference(fp4, case, causal, d):  # noqa: F811
    """The attention kernel on the reference's preprocessing with its FP8 operands and choice."""
    from sageattn3 import _attn, reference as ref

    q, k, v = ac.make(case, 1, 4, 2, 700, 700, d, seed=9)
    precision = "auto" if case != "randn" else "fp8"
    pre = ref.preprocess(q, k, v, qk_precision=precision)
    want = ref.sageattn3(q, k, v, is_causal=causal, qk_precision=precision)
    g = _pre_to(pre, "cuda")
    got = _attn.attention_qk8(g, q8=g.q8, q8_scales=g.q8_scales, k8=g.k8, k8_scales=g.k8_scales, is_causal=causal,
                              **reference_selection(g)).float().cpu()
    c = ac.cos_sim(got, want)
    fig = f"{case} D={d} causal={causal} heads fp8={pre.qk_fp8.flatten().tolist()}: kernel vs reference cos={c:.7f}"
    FIGURES.append(fig)
    assert c >= 0.99999, fig


def _massive_and_rope(dtype, sq: int, sk: int):
    """8 q heads over 2 kv heads, D 128: the first kv head's 4 from qk_massive (massive outliers shared
    by Q and K: the raw 16-bit rows), the second's from rope_bias (MXFP8 Q·Kᵀ)."""
    a = ac.make("qk_massive", 1, 4, 1, sq, sk, 128, seed=2025, dtype=dtype)
    b = ac.make("rope_bias", 1, 4, 1, sq, sk, 128, seed=3, dtype=dtype)
    return tuple(torch.cat([x, y], dim=1) for x, y in zip(a, b))


@pytest.mark.parametrize("shape", [(1000, 1000), (700, 1300)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_raw_16bit_rows_match_the_reference(fp4, causal, dtype, shape):  # noqa: F811
    """D 128: the heads whose second statistic picks the raw 16-bit rows (bit 2: Q·Kᵀ from q and k
    as they are, fp16 or bf16, no delta_s) beside MXFP8 heads in one call; lengths that are not
    multiples of 128 (the raw rows of a head's last tile run into the next head's, masked) and
    cross-attention (Sq != Sk, not causal). The attention kernel on the reference's preprocessing
    and selection (>= 0.99999, P·V in FP4); the defaults end to end, through the one op and through
    the separate ops (the debug return): the same output bit for bit, the reference's choice, the
    reference's output (>= 0.9999) and every head >= 0.98 against exact attention."""
    from sageattn3 import _attn, reference as ref

    sq, sk = shape
    if causal and sq != sk:
        pytest.skip("causal: square")
    q, k, v = _massive_and_rope(dtype, sq, sk)
    pre = ref.preprocess(q, k, v, qk_precision="auto", pv_precision="fp4")
    assert bool(pre.qk16[0, :4].all()) and not bool(pre.qk16[0, 4:].any()), (pre.qk16_stat, pre.qk_fp8)
    want = ref.sageattn3(q, k, v, is_causal=causal, pv_precision="fp4")
    g = _pre_to(pre, "cuda")
    got = _attn.attention_qk8(g, q8=g.q8, q8_scales=g.q8_scales, k8=g.k8, k8_scales=g.k8_scales, is_causal=causal,
                              out_dtype=dtype, **reference_selection(g)).float().cpu()
    c = ac.cos_sim(got, want)
    qc, kc, vc = q.cuda(), k.cuda(), v.cuda()
    out = fp4.sageattn3_blackwell(qc, kc, vc, is_causal=causal)
    out_ops, choice = fp4.sageattn3_blackwell(qc, kc, vc, is_causal=causal, return_qk_choice=True)
    want_pre = ref.preprocess(q, k, v, qk_precision="auto", is_causal=causal)
    assert torch.equal(choice.qk16.cpu(), want_pre.qk16) and torch.equal(choice.fp8.cpu(), want_pre.qk_fp8), \
        choice.describe()
    exact = ref.exact_attention(q, k, v, is_causal=causal)
    heads = [ac.cos_sim(out[0, h].float().cpu(), exact[0, h]) for h in range(8)]
    c_end = ac.cos_sim(out.float().cpu(), ref.sageattn3(q, k, v, is_causal=causal))
    fig = (f"raw 16-bit rows {str(dtype)[6:]} {sq}x{sk} causal={causal}: kernel vs reference cos={c:.7f}, whole "
           f"call {c_end:.6f}, heads vs exact {min(heads):.4f}-{max(heads):.4f}; {choice.describe()}")
    FIGURES.append(fig)
    assert c >= 0.99999 and c_end >= 0.9999 and min(heads) >= 0.98, fig
    assert torch.equal(out, out_ops), "the one op and the separate ops differ"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_raw_16bit_rows_with_fp8_pv_match_the_reference(fp4, dtype):  # noqa: F811
    """The raw 16-bit rows with P·V in MXFP8 (the kernels of bytes 5 under pv_precision="fp8" and 7
    per head: one stage, the V tile 16 KB): massive and RoPE'd heads in one call, the kernel on the
    reference's preprocessing and selection against the reference (>= 0.99999), every head and
    by head (bit 1 on the first two heads of each kind)."""
    from sageattn3 import _pv8, reference as ref

    q, k, v = _massive_and_rope(dtype, 1000, 1000)
    pre = ref.preprocess(q, k, v, qk_precision="auto", pv_precision="fp8")
    assert bool(pre.qk16[0, :4].all()) and not bool(pre.qk16[0, 4:].any()), pre.qk16_stat
    g = _pre_to(pre, "cuda")
    qk8 = {"q8": g.q8, "q8_scales": g.q8_scales, "k8": g.k8, "k8_scales": g.k8_scales, **reference_selection(g)}
    want = ref.sageattn3(q, k, v, qk_precision="auto", pv_precision="fp8")
    got = _pv8.attention_pv8(g, g.v8, g.v8_scales, out_dtype=dtype, **qk8).float().cpu()
    c = ac.cos_sim(got, want)
    pv = torch.tensor([[True, True, False, False, True, True, False, False]])
    pre.pv_fp8 = pv  # the reference's per-head P·V: the FP8 loop where pv_fp8 says
    sel = dict(qk8, head_sel=qk8["head_sel"] | (pv.cuda().to(torch.uint8) << 1))
    got_mixed = _pv8.attention_pv8(g, g.v8, g.v8_scales, out_dtype=dtype, by_head=True, **sel).float().cpu()
    from sageattn3.reference.attention import _attend

    want_mixed = _attend(pre, None, False, 128, False)
    c_mixed = ac.cos_sim(got_mixed, want_mixed)
    fig = f"raw 16-bit rows + FP8 P·V {str(dtype)[6:]}: every head cos={c:.7f}, by head cos={c_mixed:.7f}"
    FIGURES.append(fig)
    assert c >= 0.99999 and c_mixed >= 0.99999, fig


@pytest.mark.parametrize("dtype,causal", [(torch.bfloat16, False), (torch.float16, True)])
def test_raw_16bit_rows_several_tiles_a_cta(fp4, dtype, causal):  # noqa: F811
    """The raw 16-bit rows where a CTA walks several tiles (2 batches x 8 heads x 4096 tokens: 512
    tiles, more than the grid of any launch), P·V in FP4 and, per head, in MXFP8: the kernels on
    the reference's preprocessing against the reference (>= 0.99999), all on the GPU."""
    from sageattn3 import _attn, _pv8, reference as ref

    parts = [_massive_and_rope(dtype, 4096, 4096) for _ in range(2)]
    q, k, v = (torch.cat(x, dim=0).cuda() for x in zip(*parts))
    tiles = q.shape[0] * q.shape[1] * (q.shape[2] // 128)
    assert tiles > 2 * torch.cuda.get_device_properties(0).multi_processor_count
    pre = ref.preprocess(q, k, v, qk_precision="auto", pv_precision="fp4", is_causal=causal)
    assert bool(pre.qk16[:, :4].all()) and not bool(pre.qk16[:, 4:].any()), pre.qk16_stat
    sel = reference_selection(pre)
    got = _attn.attention_qk8(pre, q8=pre.q8, q8_scales=pre.q8_scales, k8=pre.k8, k8_scales=pre.k8_scales,
                              is_causal=causal, out_dtype=dtype, **sel).float()
    c = ac.cos_sim(got, ref.sageattn3(q, k, v, is_causal=causal, pv_precision="fp4"))
    pre8 = ref.preprocess(q, k, v, qk_precision="auto", pv_precision="fp8", is_causal=causal)
    pv = torch.tensor([[True, False, True, False, True, False, True, False]] * 2, device="cuda")
    pre8.pv_fp8 = pv
    sel8 = reference_selection(pre8)
    sel8["head_sel"] = sel8["head_sel"] | (pv.to(torch.uint8) << 1)
    got8 = _pv8.attention_pv8(pre8, pre8.v8, pre8.v8_scales, out_dtype=dtype, by_head=True, is_causal=causal,
                              q8=pre8.q8, q8_scales=pre8.q8_scales, k8=pre8.k8, k8_scales=pre8.k8_scales,
                              **sel8).float()
    from sageattn3.reference.attention import _attend

    c8 = ac.cos_sim(got8, _attend(pre8, None, causal, 128, False))
    fig = (f"raw 16-bit rows, {tiles} tiles, {str(dtype)[6:]} causal={causal}: FP4 P·V cos={c:.7f}, "
           f"per-head FP8 P·V cos={c8:.7f}")
    FIGURES.append(fig)
    assert c >= 0.99999 and c8 >= 0.99999, fig


TARGET = {"rope_bias": 0.98, "q_outliers": 0.98, "k_outliers": 0.98, "k_sink": 0.98, "peaky": 0.97,
          "mixed_heads": 0.98, "randn": 0.98, "qk_outliers": 0.98, "qk_massive": 0.98}
# Where the defaults are known to fall short of the 0.98, and the bound held instead: none
# since the 16-bit Q·Kᵀ at D 64 (the massive shared outliers there were 0.9765-0.9805 with MXFP8:
# docs/accuracy-auto-details.md, "Massive shared outliers").
KNOWN_SHORT: dict = {}


@pytest.mark.parametrize("case", list(TARGET))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d,dtype", [(128, torch.bfloat16), (64, torch.bfloat16), (64, torch.float16)])
def test_defaults_end_to_end(fp4, case, causal, d, dtype):  # noqa: F811
    """sageattn3_blackwell with the defaults (auto) on the hard cases: the same choice as the
    reference, its output (cos-sim >= 0.9999: the means are summed in another order), and the
    issue's targets against exact attention; fp4 and fp8 figures beside it."""
    from sageattn3 import reference as ref

    if dtype == torch.float16 and case not in ("qk_outliers", "qk_massive", "randn"):
        pytest.skip("fp16: the shared-outlier cases and zero-mean data")
    q, k, v = ac.make(case, 1, 8, 2, 1000, 1000, d, seed=21, dtype=dtype)
    qc, kc, vc = q.cuda(), k.cuda(), v.cuda()
    exact = ref.exact_attention(q, k, v, is_causal=causal)
    out, choice = fp4.sageattn3_blackwell(qc, kc, vc, is_causal=causal, return_qk_choice=True)
    want_pre = ref.preprocess(q, k, v, qk_precision="auto")
    assert torch.equal(choice.fp8.cpu(), want_pre.qk_fp8), (choice.describe(), want_pre.qk_error)
    want = ref.sageattn3(q, k, v, is_causal=causal)
    cos = {"auto": ac.cos_sim(out.float().cpu(), exact)}
    for p in ("fp4", "fp8"):
        cos[p] = ac.cos_sim(fp4.sageattn3_blackwell(qc, kc, vc, is_causal=causal, qk_precision=p).float().cpu(), exact)
    c_ref = ac.cos_sim(out.float().cpu(), want)
    fig = (f"{case} D={d} {str(dtype)[6:]} causal={causal}: vs exact fp4 {cos['fp4']:.4f} auto {cos['auto']:.4f} fp8 {cos['fp8']:.4f}; "
           f"auto kernels vs reference {c_ref:.6f}; {choice.describe()}")
    FIGURES.append(fig)
    assert c_ref >= 0.9999, fig
    assert cos["auto"] >= KNOWN_SHORT.get((case, d), TARGET[case]), fig


@pytest.mark.parametrize("case", ac.EASY_CASES)
def test_auto_is_fp4_bit_for_bit_where_no_head_needs_help(fp4, case):  # noqa: F811
    q, k, v = (x.cuda() for x in ac.make(case, 2, 8, 2, 777, 777, 128, seed=3))
    out, choice = fp4.sageattn3_blackwell(q, k, v, is_causal=True, return_qk_choice=True)
    assert not bool(choice.fp8.any()), choice.describe()
    assert torch.equal(out, fp4.sageattn3_blackwell(q, k, v, is_causal=True, qk_precision="fp4"))


def test_cuda_graph_and_compile(fp4):  # noqa: F811
    """"auto" on the device: captured into a CUDA graph (no host synchronisation, no host data)
    and compiled with fullgraph=True; both give the eager output, FP8 heads included."""
    q, k, v = (x.cuda() for x in ac.make("mixed_heads", 1, 4, 2, 512, 512, 128, seed=4))
    eager = fp4.sageattn3_blackwell(q, k, v)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fp4.sageattn3_blackwell(q, k, v)  # warm-up outside capture (self-check, path decided)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fp4.sageattn3_blackwell(q, k, v)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
    q.copy_(torch.flip(q, dims=[1]))  # new inputs, same buffers: the rule re-decides on replay
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, fp4.sageattn3_blackwell(q, k, v))
    compiled = torch.compile(lambda a, b, c: fp4.sageattn3_blackwell(a, b, c), fullgraph=True)
    assert torch.equal(compiled(q, k, v), fp4.sageattn3_blackwell(q, k, v))


def test_choice_and_errors(fp4):  # noqa: F811
    q, k, v = (x.cuda() for x in ac.make("mixed_heads", 1, 4, 2, 256, 256, 64, seed=4))
    choice = fp4.qk_choice(q, k, v)
    assert choice.fp8.flatten().tolist() == [False, True, True, True], choice.describe()
    assert "fp8" in choice.describe() and choice.error.device.type == "cuda"
    auto_rot = fp4.qk_choice(q, k, v, qk_rotation=True)  # the rule on the rotated rows, from the kernel
    assert auto_rot.error is not None and auto_rot.error.device.type == "cuda", auto_rot.describe()
    from sageattn3 import reference as ref

    assert torch.equal(auto_rot.fp8, auto_rot.error > ref.AUTO_ERROR_LIMIT)
    with pytest.raises(ValueError, match="qk_precision must be one of"):
        fp4.sageattn3_blackwell(q, k, v, qk_precision="int8")


def test_zz_report_figures():
    print("\n".join(FIGURES))


@pytest.mark.parametrize("case,sq,sk,d,seed", [("qk_outliers", 8, 2048, 128, 5), ("qk_massive", 8, 2048, 64, 3),
                                                ("randn", 100, 700, 64, 1), ("randn", 1, 700, 128, 1)])
def test_short_queries_on_the_kernels(fp4, case, sq, sk, d, seed):  # noqa: F811
    """"auto" on 2 to 127 query rows: every head FP8 Q·Kᵀ (``reference.rule_limit``), the one op as
    the reference (cos-sim >= 0.99999) and the hard heads the estimate used to miss at >= 0.98; one
    query row keeps the rule's limit (its estimate 0 here: every head FP4 Q·Kᵀ)."""
    from sageattn3 import reference as ref

    q, k, v = ac.make(case, 1, 4, 2, sq, sk, d, seed=seed)
    qc, kc, vc = q.cuda(), k.cuda(), v.cuda()
    out, choice = fp4.sageattn3_blackwell(qc, kc, vc, return_qk_choice=True)
    assert bool(choice.fp8.all()) == (1 < sq < 128) and choice.limit == ref.rule_limit(sq), choice.describe()
    one = fp4.sageattn3_blackwell(qc, kc, vc)  # the one op (return_qk_choice runs the separate ops)
    assert torch.equal(one, out)
    want = ref.sageattn3(q, k, v)
    exact = ref.exact_attention(q, k, v)
    heads = [ac.cos_sim(one[:, h].float().cpu(), exact[:, h]) for h in range(4)]
    c_ref = ac.cos_sim(one.float().cpu(), want)
    FIGURES.append(f"short query {case} {sq}x{sk} D={d}: kernels vs reference {c_ref:.7f}; heads vs exact "
                   f"{', '.join(f'{c:.4f}' for c in heads)}; {choice.describe()}")
    assert c_ref >= 0.99999, FIGURES[-1]
    if sq == 1:
        assert not bool(choice.fp8.any()), FIGURES[-1]
    else:
        assert min(heads) >= 0.98, FIGURES[-1]
