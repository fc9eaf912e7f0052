"""Fused preprocessing on the GPU against the reference (means compared with a tolerance, the
quantized tensors bit for bit given the kernel's means and balance exponents, with and without
the Q/K rotation and the channel balance; mean_q_global and the per-key correction delta_key
with a tolerance)."""


import pytest
import torch

import attention_cases
from gpu_common import kernels_or_skip, same_bytes


def qkv(b, hq, hk, sq, sk, d, dtype, seed=0, outliers=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, sq, d, generator=g) + torch.randn(d, generator=g)
    big = torch.randperm(d, generator=g)[:4]
    if outliers is True:  # a few large Q channels: the channel balance scales them (e > 0)
        q[..., big] *= torch.tensor([8.0, 12.0, 16.0, 20.0])
    k = torch.randn(b, hk, sk, d, generator=g) + 3 * torch.randn(d, generator=g)
    if outliers == "k":  # a few large K channels (e < 0)
        k[..., big] *= torch.tensor([8.0, 12.0, 16.0, 20.0])
    v = torch.randn(b, hk, sk, d, generator=g) + 2 * torch.randn(d, generator=g)
    return (t.to(dtype).cuda() for t in (q, k, v))


def close_delta_key(got, want):
    """The kernels' fp32 dot products vs the reference's float64 ones."""
    scale = want.abs().max().clamp_min(1.0)
    return got.shape == want.shape and bool((got.cpu() - want).abs().max() <= 2e-5 * scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("per_block_mean", [True, False])
@pytest.mark.parametrize("rotation,outliers,search", [(True, False, False), (False, False, False), (False, True, False),
                                                      (True, True, False), (False, False, True), (False, True, True),
                                                      (True, True, True), (False, "k", False), (True, "k", True)])
@pytest.mark.parametrize("b,hq,hk,sq,sk,d", [(1, 2, 2, 128, 128, 64), (2, 4, 2, 300, 1000, 128),
                                             (1, 3, 1, 17, 5, 64), (1, 2, 1, 1, 1, 128), (1, 2, 2, 2000, 700, 48),
                                             (1, 40, 1, 200, 300, 128), (1, 25, 1, 130, 260, 128),
                                             (1, 26, 1, 130, 260, 128)])
def test_preprocess_matches_reference(dtype, per_block_mean, rotation, outliers, search, b, hq, hk, sq, sk, d):
    """(1, 40, 1, ...): more q heads per kv head than the K kernels take for the correction
    (delta_key from torch ops; the balance on float32 copies); D 48: no rotation, no balance,
    correction from torch ops. outliers: the channel balance scales channels (exponents != 0).
    search: the scale search (D 64/128), through the keyword for the kernels and the module
    default for the reference."""
    sa = kernels_or_skip()
    from sageattn3 import reference as ref

    q, k, v = qkv(b, hq, hk, sq, sk, d, dtype, seed=sq + sk, outliers=outliers)
    copies = [t.clone() for t in (q, k, v)]
    pre = sa.preprocess(q, k, v, per_block_mean=per_block_mean, qk_rotation=rotation, qk_balance=True,
                        qk_scale_search=search)
    for t, c in zip((q, k, v), copies):
        assert torch.equal(t, c)
    assert pre.qk_scale_search is (search and d in (64, 128))
    ref_default = ref.QK_SCALE_SEARCH
    ref.QK_SCALE_SEARCH = search  # every reference call below: the same quantizer as the kernels'
    try:
        _check_against_reference(pre, q, k, v, per_block_mean, rotation, outliers, hk, sq, d)
    finally:
        ref.QK_SCALE_SEARCH = ref_default


def _check_against_reference(pre, q, k, v, per_block_mean, rotation, outliers, hk, sq, d):
    from sageattn3 import reference as ref

    assert pre.qk_rotation is (rotation and d in (64, 128))
    assert (pre.balance is not None) is (per_block_mean and d in (64, 128))
    want = ref.preprocess(q.cpu(), k.cpu(), v.cpu(), per_block_mean=per_block_mean, qk_rotation=rotation,
                          qk_balance=True, qk_scale_search=ref.QK_SCALE_SEARCH)
    bal = None
    if pre.balance is not None:
        bal = pre.balance.cpu()
        assert balance_agrees(bal, want.balance, q.cpu(), k.cpu())
        if outliers and sq > 1:  # one token: Q minus its mean is 0, nothing to balance
            assert bool((bal != 0).any())
        want = ref.preprocess(q.cpu(), k.cpu(), v.cpu(), per_block_mean=per_block_mean, qk_rotation=rotation,
                              qk_balance=True, balance=bal, qk_scale_search=ref.QK_SCALE_SEARCH)
    for name in ("mean_q", "mean_k", "mean_q_global"):
        assert torch.allclose(getattr(pre, name).cpu(), getattr(want, name), rtol=1e-5, atol=1e-5), name
    # bit-exact quantization given the kernel's own means (and balance exponents)
    exact = ref.preprocess(q.cpu(), k.cpu(), v.cpu(), per_block_mean=per_block_mean, mean_q=pre.mean_q.cpu(),
                           mean_k=pre.mean_k.cpu(), mean_q_global=pre.mean_q_global.cpu(), qk_rotation=rotation,
                           qk_balance=True, balance=bal, qk_scale_search=ref.QK_SCALE_SEARCH)
    # V's tile exponents: at head dims that are multiples of 32, in the kernels as in the reference
    assert (pre.v_exp is None) is (exact.v_exp is None) is (d % 32 != 0)
    for name in ("q_packed", "q_scales", "k_packed", "k_scales", "v_packed", "v_scales") + (
            ("v_exp",) if exact.v_exp is not None else ()):
        got, ref_t = getattr(pre, name), getattr(exact, name)
        assert got.shape == ref_t.shape, name
        assert same_bytes(got, ref_t), name
    # K's quantization residual: with per-block Q means only, bit-exact too
    assert (pre.k_residual is None) is (not per_block_mean)
    if per_block_mean:
        assert pre.k_residual.dtype == torch.float16 and pre.k_residual.shape == exact.k_residual.shape
        assert same_bytes(pre.k_residual, exact.k_residual), "k_residual"
    assert close_delta_key(pre.delta_key, exact.delta_key)
    assert pre.delta_s.shape == want.delta_s.shape
    assert close_delta_key(pre.delta_s, exact.delta_s)


def balance_agrees(got, want, q, k):
    """The kernel's balance exponents equal the reference's, except for a channel whose RMS
    ratio r_d sits within float32 rounding of a threshold against the mean ratio m (the two sum
    in different orders)."""
    if torch.equal(got, want):
        return True
    b, hq, _, d = q.shape
    hk = k.shape[1]

    def mean_square(x):
        ss, count = 0, 0
        for t in ref_mod().sample_blocks(x.shape[-2]):
            blk = x.double()[..., t * 128:min(x.shape[-2], (t + 1) * 128), :]
            ss = ss + ((blk - blk.mean(dim=-2, keepdim=True)) ** 2).sum(dim=-2)
            count += blk.shape[-2]
        return ss, count

    ssq, nq = mean_square(q)
    ssk, nk = mean_square(k)
    r = (ssq.reshape(b, hk, -1, d).sum(dim=2) / (nq * (hq // hk))).sqrt() / (ssk / nk).sqrt()
    valid = torch.isfinite(r) & (r > 0)
    m = torch.where(valid, r, torch.zeros_like(r)).sum(dim=-1, keepdim=True) / valid.sum(dim=-1, keepdim=True)
    ratio = (r / m).unsqueeze(-2)
    near = torch.zeros_like(ratio, dtype=torch.bool)
    for t in (2.0, 8.0, 0.5, 0.125):
        near |= (ratio / t - 1).abs() < 1e-4
    return bool(((got == want) | near).all())


def ref_mod():
    from sageattn3 import reference

    return reference


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("gq,gk,s,d", [(2, 2, 1, 64), (4, 2, 300, 128), (6, 3, 1025, 64), (8, 1, 5000, 128),
                                       (24, 24, 4096, 128)])
@pytest.mark.parametrize("outliers", ["none", "q", "k", "both"])
def test_balance_exponents_match_reference(dtype, gq, gk, s, d, outliers):
    """Outlier channels in Q move into K (e = 2), in K into Q (e = -2), in both stay (e = 0)."""
    kernels_or_skip()
    from sageattn3 import _kernels
    from sageattn3 import reference as ref

    g = torch.Generator().manual_seed(gq * 1000 + s + d)
    sk = 2 * s + 37  # other sampled tile counts than Q's (300 -> 3 and 5)
    q = torch.randn(1, gq, s, d, generator=g) * 2 + torch.randn(d, generator=g)
    k = torch.randn(1, gk, sk, d, generator=g) + 3 * torch.randn(d, generator=g)
    ch = torch.randperm(d, generator=g)[:5]
    scale = torch.tensor([3.0, 8.0, 12.0, 20.0, 0.01])
    if outliers in ("q", "both"):
        q[..., ch] *= scale
    if outliers in ("k", "both"):
        k[..., ch] *= scale
    q, k = q.to(dtype), k.to(dtype)
    q3, k3 = q.cuda().view(gq, s, d).contiguous(), k.cuda().view(gk, sk, d).contiguous()
    got = _kernels.qk_balance(q3, k3).cpu().view(1, gk, 1, d)
    want = ref.balance_exponents(q, k)
    assert balance_agrees(got, want, q, k)
    if s > 1:
        big = got[..., ch[3]]  # the x20 channel
        assert bool((big == {"none": 0, "q": 2, "k": -2, "both": 0}[outliers]).all()), (outliers, big)
    again = _kernels.qk_balance(q3, k3).cpu().view(1, gk, 1, d)
    assert torch.equal(again, got)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gq,gk,sq,sk,d", [(4, 2, 300, 1000, 128), (3, 1, 17, 5, 64), (24, 24, 2048, 2048, 128),
                                           (2, 2, 1, 1, 64)])
@pytest.mark.parametrize("rotate,search", [(False, False), (True, True)])
def test_balanced_launch_equals_balanced_float32_copies(dtype, gq, gk, sq, sk, d, rotate, search):
    """The fused launch's balance (factors applied in registers, before the rotation) gives the
    same bits as the unbalanced kernels run on float32 copies of Q and K scaled by the same
    powers of two."""
    kernels_or_skip()
    from sageattn3 import _kernels

    g = torch.Generator().manual_seed(sq + sk + d)
    q = torch.randn(gq, sq, d, generator=g) + torch.randn(d, generator=g)
    q[..., torch.randperm(d, generator=g)[:4]] *= torch.tensor([8.0, 12.0, 16.0, 20.0])
    k = torch.randn(gk, sk, d, generator=g) + 3 * torch.randn(d, generator=g)
    q, k = q.to(dtype).cuda(), k.to(dtype).cuda()
    got = _kernels.smooth_quant_qk_key(q, k, 128, rotate=rotate, balance=True, search=search)
    exps = got[8]
    assert torch.equal(exps, _kernels.qk_balance(q, k))
    if sq > 1:
        assert bool((exps != 0).any())
    c = torch.exp2(exps)
    q32 = (q.view(gk, gq // gk, sq, d).float() / c.unsqueeze(1)).view(gq, sq, d)
    k32 = k.float() * c
    plain = _kernels.smooth_quant_qk_key(q32, k32, 128, rotate=rotate, search=search)
    for i, name in enumerate(("q_packed", "q_scales", "mean_q", "k_packed", "k_scales", "mean_k", "qbar")):
        assert same_bytes(got[i], plain[i]), name
    assert same_bytes(got[9], plain[9]), "k_res"  # K's quantization residual, from the same fp32 rows
    scale = plain[7].abs().max().clamp_min(1.0)
    assert (got[7] - plain[7]).abs().max() <= 2e-5 * scale  # ds_key: the same dots, other operands' bits
    again = _kernels.smooth_quant_qk_key(q, k, 128, rotate=rotate, balance=True, search=search)
    for a, b in zip(again, got):
        assert same_bytes(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b,hq,hk,sq,sk,d", [(1, 2, 1, 8300, 300, 64),    # > 64 Q-mean rows: several chunks
                                             (1, 3, 3, 130, 2049, 128),   # several 256-key tiles, ragged end
                                             (2, 4, 1, 256, 513, 32)])    # MQA, small D
def test_fused_k_delta_matches_reference(dtype, b, hq, hk, sq, sk, d):
    """The standalone fused K smoothing + quantization + tensor-core delta_s op (D <= 128; no
    longer used by preprocess, whose delta_s the attention kernel computes): its delta_s is
    mean_q . (K - mean_k)^T of the unquantized smoothed K."""
    sa = kernels_or_skip()
    from sageattn3 import reference as ref

    q, k, v = qkv(b, hq, hk, sq, sk, d, dtype, seed=sq * 7 + sk)
    pre = sa.preprocess(q, k, v, per_block_mean=True, qk_rotation=False)
    skp = -(-sk // 128) * 128
    kp = torch.empty((b, hk, skp, d // 2), dtype=torch.uint8, device=k.device)
    ksc = torch.empty((b, hk, skp, d // 16), dtype=torch.float8_e4m3fn, device=k.device)
    ds = torch.empty((b, hq, pre.mean_q.shape[2], skp), dtype=torch.float32, device=k.device)
    torch.ops.sageattn3.smooth_quant_k_delta(k, pre.mean_k, pre.mean_q, kp, ksc, ds)
    assert same_bytes(kp, pre.k_packed) and same_bytes(ksc, pre.k_scales)
    want = ref.delta_s(pre.mean_q.cpu(), k.cpu().float() - pre.mean_k.cpu())
    scale = want.abs().max().clamp_min(1.0)
    assert (ds[..., :sk].cpu() - want).abs().max() <= 2e-5 * scale
    assert torch.all(ds[..., sk:] == 0)


def test_single_key_residual_is_exactly_zero():
    """K == mean_k for one key: its smoothed row is 0, so its codes, delta_key (mean_q_global .
    K_s) and the block residuals' part r . K^ are all exactly 0, as in the reference."""
    sa = kernels_or_skip()
    q, k, v = qkv(1, 2, 2, 300, 1, 128, torch.bfloat16, seed=5)
    pre = sa.preprocess(q, k, v, per_block_mean=True)
    assert torch.all(pre.k_packed == 0)
    assert torch.all(pre.delta_key[..., 0] == 0)
    assert torch.equal(pre.delta_s[..., 0].cpu(), pre.delta_key[..., None, 0].expand(-1, -1, 3).cpu())


def test_misaligned_inputs():
    """Views whose storage offset breaks 16-byte alignment are copied, not misread."""
    sa = kernels_or_skip()
    from sageattn3 import reference as ref

    base = torch.randn(2 * 4 * 200 * 64 + 1, dtype=torch.bfloat16, device="cuda")
    x = base[1:].view(2, 4, 200, 64)
    assert x.data_ptr() % 16
    p, s = sa.scale_and_quant_fp4(x)
    rp, rs = ref.quantize_rows(x.cpu())
    assert same_bytes(p, rp) and same_bytes(s, rs)
    p, s = sa.scale_and_quant_fp4_transpose(x)
    rp, rs = ref.quantize_transposed(x.cpu())
    assert same_bytes(p, rp) and same_bytes(s, rs)
    pre = sa.preprocess(x, x[:, :2], x[:, :2])
    want = ref.preprocess(x.cpu(), x[:, :2].cpu(), x[:, :2].cpu(), mean_q=pre.mean_q.cpu(), mean_k=pre.mean_k.cpu())
    assert same_bytes(pre.k_packed, want.k_packed) and same_bytes(pre.q_packed, want.q_packed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("g,s,d,pad", [(1, 1, 64, 128), (3, 17, 128, 128), (2, 128, 64, 16), (5, 129, 128, 128),
                                       (2, 1000, 48, 16), (24, 4096, 128, 128), (4, 3000, 256, 128)])
@pytest.mark.parametrize("rotate,search", [(False, False), (True, False), (False, True), (True, True)])
def test_seq_mean_sampled_and_reference(dtype, g, s, d, pad, rotate, search):
    """Smoothing by the sampled mean (reference.sample_mean: up to 8 evenly spaced 128-row
    blocks): the reference's mean, and the reference's bits given the kernel's mean; rotated
    rows (D 64/128) too, with the per-key correction of 3 q heads per group (the reference's
    values over the smoothed rows, the same codes as without it); with the scale search too."""
    if rotate and d not in (64, 128):
        pytest.skip("the rotation is defined for D 64/128")
    kernels_or_skip()
    from sageattn3 import _kernels
    from sageattn3 import reference as ref

    gen = torch.Generator().manual_seed(s * 31 + d)
    x = (torch.randn(g, s, d, generator=gen) * 2 + 5 * torch.randn(d, generator=gen)).to(dtype).cuda()
    if search and d not in (64, 128):  # the search exists at the attention's head dims only
        with pytest.raises(RuntimeError, match="the scale search needs D 64 or 128"):
            _kernels.smooth_quant_seq(x, pad, search=True)
        return
    one = _kernels.smooth_quant_seq(x, pad, rotate=rotate, search=search)
    packed, scales, mean = one
    turn = ref.rotate if rotate else (lambda t: t.float())
    assert torch.allclose(mean.cpu(), turn(ref.sample_mean(x.cpu())), rtol=1e-5, atol=1e-5)
    if s > 1024:  # not the whole sequence's mean
        assert not torch.allclose(mean.cpu(), turn(x.cpu().float().mean(dim=1, keepdim=True)), rtol=0, atol=1e-4)
    if d in (64, 128):
        qbar = (torch.randn(3 * g, 1, d, generator=gen) + 2).cuda()
        k1 = _kernels.smooth_quant_seq_key(x, pad, qbar, rotate=rotate, search=search)
        for a, b in zip(k1[:3], one):
            assert same_bytes(a, b)
        ks = turn(x.cpu()) - mean.cpu()
        want = ref.delta_s(qbar.cpu().view(g, 3, 1, d), ks.unsqueeze(1)).view(3 * g, s)
        assert close_delta_key(k1[3][:, :s], want) and bool((k1[3][:, s:] == 0).all())
    sp = -(-s // pad) * pad
    smoothed = torch.zeros(g, sp, d)
    smoothed[:, :s] = turn(x.cpu().float()) - mean.cpu()
    rp, rs = ref.quantize_rows(smoothed, scale_search=search)
    assert same_bytes(packed, rp) and same_bytes(scales, rs)
    if search and s > 1:  # the search moved some blocks onto the amax / 4 scale (one row: all zeros)
        assert not same_bytes(scales, ref.quantize_rows(smoothed)[1])
    # repeated launches give the same bits
    again = _kernels.smooth_quant_seq(x, pad, rotate=rotate, search=search)
    for a, b in zip(one, again):
        assert same_bytes(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("gq,sq,gk,sk,d,pad", [(2, 300, 2, 1000, 128, 128), (4, 17, 1, 5000, 64, 16),
                                               (3, 129, 3, 1, 48, 128), (2, 1, 2, 257, 256, 128),
                                               (24, 2048, 24, 2048, 128, 128), (8, 4000, 2, 4000, 64, 128),
                                               (0, 5, 40, 300, 64, 16)])
def test_qk_one_launch_equals_separate_ops(dtype, gq, sq, gk, sk, d, pad):
    """One launch for Q's block means + quantization and K's smoothing by its sampled mean: the
    same bits as the separate ops (smooth_quant_rows with compute_mean for Q; smooth_quant_seq
    for K), for GQA/MQA shapes, different Q/K lengths and no Q at all. With the per-key
    correction (D 64/128, rotated or not): qbar has the bits of Q's own sampled mean
    (smooth_quant_seq) and ds_key those of smooth_quant_seq_key given that qbar."""
    kernels_or_skip()
    from sageattn3 import _kernels

    gen = torch.Generator().manual_seed(gq * 100 + sk + d)
    q = (torch.randn(gq, sq, d, generator=gen) * 2 + torch.randn(d, generator=gen)).to(dtype).cuda()
    k = (torch.randn(gk, sk, d, generator=gen) + 3 * torch.randn(d, generator=gen)).to(dtype).cuda()
    for rotate in ((False, True) if d in (64, 128) else (False,)):
        key = gq > 0 and d in (64, 128)
        run = _kernels.smooth_quant_qk_key if key else _kernels.smooth_quant_qk
        got = run(q, k, pad, rotate=rotate)
        qp, qsc, mean_q, kp, ksc, mean_k = got[:6]
        mean_q2 = torch.empty_like(mean_q)
        qp2, qsc2 = _kernels.smooth_quant_rows(q, mean_q2, True, 128, pad, rotate=rotate)
        assert same_bytes(mean_q, mean_q2) and same_bytes(qp, qp2) and same_bytes(qsc, qsc2)
        kp2, ksc2, mean_k2 = _kernels.smooth_quant_seq(k, pad, rotate=rotate)
        assert same_bytes(mean_k, mean_k2) and same_bytes(kp, kp2) and same_bytes(ksc, ksc2)
        if key:
            qbar, ds_key = got[6:8]
            assert same_bytes(qbar, _kernels.smooth_quant_seq(q, pad, rotate=rotate)[2])
            assert same_bytes(ds_key, _kernels.smooth_quant_seq_key(k, pad, qbar, rotate=rotate)[3])
        again = run(q, k, pad, rotate=rotate)
        for a, b in zip(again, got):
            assert (a is None and b is None) or same_bytes(a, b)


def test_qk_rejects_mismatched_inputs():
    kernels_or_skip()
    from sageattn3 import _kernels

    q = torch.randn(2, 64, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="same dtype"):
        _kernels.smooth_quant_qk(q, q.half(), 128)
    with pytest.raises(RuntimeError, match="same head dim"):
        _kernels.smooth_quant_qk(q, torch.randn(2, 64, 128, device="cuda", dtype=torch.bfloat16), 128)
    with pytest.raises(RuntimeError, match="k must not be empty"):
        _kernels.smooth_quant_qk(q, q[:, :0], 128)
    with pytest.raises(RuntimeError, match="multiple of k groups"):
        _kernels.smooth_quant_qk(q[:1], q, 128)
    with pytest.raises(RuntimeError, match="rotate needs D 64 or 128"):
        _kernels.smooth_quant_qk(q[..., :48].contiguous(), q[..., :48].contiguous(), 128, rotate=True)
    torch.cuda.synchronize()


def test_seq_mean_large_groups():
    """Groups with more tiles than the device holds at once and larger than the L2: the
    reference's sampled mean, and the last group's last rows quantized from that mean."""
    kernels_or_skip()
    from sageattn3 import _kernels

    props = torch.cuda.get_device_properties(0)
    d = 64
    s = max(128 * (props.multi_processor_count * 16 + 7), props.L2_cache_size // (d * 2) + 77)
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(3, s, d, generator=gen) + torch.randn(d, generator=gen)).to(torch.bfloat16).cuda()
    one = _kernels.smooth_quant_seq(x, 128)
    torch.cuda.synchronize()
    from sageattn3 import reference as ref
    assert torch.allclose(one[2].cpu(), ref.sample_mean(x.cpu()), rtol=1e-4, atol=1e-4)
    last = x[2:, -5:].cpu().float() - one[2][2:].cpu()
    rp, rs = ref.quantize_rows(last)
    assert same_bytes(one[0][2:, s - 5:s], rp) and same_bytes(one[1][2:, s - 5:s], rs)


def test_direct_op_rejects_misaligned_input():
    """A direct op call with a misaligned view is an error naming the argument, not a CUDA fault."""
    kernels_or_skip()
    base = torch.randn(4 * 64 + 8, dtype=torch.bfloat16, device="cuda")
    x = base[8:].view(4, 64)  # 16-byte offset: aligned; base[1:] is not
    torch.ops.sageattn3.quant_fp4_rows(x, torch.empty(4, 32, dtype=torch.uint8, device="cuda"),
                                       torch.empty(4, 4, dtype=torch.uint8, device="cuda"))
    bad = base[1:257].view(4, 64)
    with pytest.raises(RuntimeError, match="x must be 16-byte aligned"):
        torch.ops.sageattn3.quant_fp4_rows(bad, torch.empty(4, 32, dtype=torch.uint8, device="cuda"),
                                           torch.empty(4, 4, dtype=torch.uint8, device="cuda"))
    torch.cuda.synchronize()


def test_seq_mean_under_graph_capture():
    """Captured into a CUDA graph (the sampled sums, the means and the quantization): replays
    give the same bits as an eager call."""
    kernels_or_skip()
    from sageattn3 import _kernels

    x = (torch.randn(4, 300, 128, device="cuda") + 1).to(torch.bfloat16)
    graph_replays_equal_eager(lambda: _kernels.smooth_quant_seq(x, 128))


def graph_replays_equal_eager(call):
    """call() captured into a CUDA graph (after a warm-up outside it): two replays, each into
    zeroed outputs, give the bits of an eager call."""
    eager = call()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    for _ in range(2):
        for t in captured:
            t.zero_()
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(eager, captured):
            assert same_bytes(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_smoothing_quant_inf_nan_blocks(dtype):
    """The smoothing kernels' block amax propagates NaN (the block's scale is NaN, its codes 0)
    and saturates Inf, as the reference does."""
    kernels_or_skip()
    from sageattn3 import _kernels
    from sageattn3 import reference as ref

    gen = torch.Generator().manual_seed(11)
    x = torch.randn(2, 300, 64, generator=gen)
    x[0, 3, 5] = float("inf")
    x[0, 4, 17] = float("-inf")
    x[1, 200, 40] = float("nan")
    x[1, 201, :16] = 0.0
    x = x.to(dtype)
    mean = torch.randn(2, 1, 64, generator=gen)
    p, s = _kernels.smooth_quant_rows(x.cuda(), mean.cuda(), False, 0, 128)
    smoothed = torch.zeros(2, 384, 64)
    smoothed[:, :300] = x.float() - mean
    rp, rs = ref.quantize_rows(smoothed)
    assert same_bytes(p, rp) and same_bytes(s, rs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scale_search_special_blocks(dtype):
    """The kernels' scale search on blocks made to stress it, bit for bit with the reference: the
    5/6 pattern the search moves onto amax / 4, ties, zeros, NaN, Inf, huge values (saturated
    scales), blocks whose amax / 6 underflows E4M3 while amax / 4 does not, and random blocks."""
    kernels_or_skip()
    from sageattn3 import _kernels
    from sageattn3 import reference as ref

    nan, inf = float("nan"), float("inf")
    rows = [[5.0] * 15 + [6.0], [6.0] + [0.0] * 15, [0.0] * 16, [nan] + [1.0] * 15, [inf] + [1.0] * 15,
            [-3.0e38] + [2.0] * 15, [0.005] + [0.004] * 15, [0.0022] + [-0.0017] * 15, [1e-30] * 16]
    g = torch.Generator().manual_seed(9)
    blocks = torch.tensor(rows, dtype=torch.float32)
    blocks = torch.cat([blocks, torch.randn(247, 16, generator=g) * torch.exp(3 * torch.randn(247, 1, generator=g))])
    if dtype != torch.float32:  # values that survive the cast (no NaN/Inf blocks reach 16-bit here)
        blocks = blocks[torch.isfinite(blocks).all(dim=1) & (blocks.abs() < 1e30).all(dim=1)]
    blocks = blocks[: blocks.shape[0] // 8 * 8]
    x = blocks.reshape(-1, 8, 16).reshape(1, -1, 128)  # rows of 8 blocks
    x = x.to(dtype)
    mean = torch.zeros(1, 1, 128, device="cuda")
    packed, scales = _kernels.smooth_quant_rows(x.cuda(), mean, False, 0, 16, search=True)
    rp, rs = ref.quantize_rows(ref.pad_dim(x.float(), -2, 16), scale_search=True)
    assert same_bytes(packed, rp) and same_bytes(scales, rs)
    plain = ref.quantize_rows(ref.pad_dim(x.float(), -2, 16))[1]
    assert not same_bytes(scales, plain)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("per_block_mean,rotate,balance,search", [(True, False, False, False), (True, True, True, True),
                                                                  (False, True, False, False), (True, False, True, False),
                                                                  (False, False, False, True)])
@pytest.mark.parametrize("b,hq,hk,sq,sk,d,pad", [(1, 4, 2, 300, 1000, 128, 128), (2, 3, 1, 17, 5, 64, 16),
                                                 (1, 25, 1, 130, 260, 128, 128), (1, 2, 2, 1, 1, 64, 128),
                                                 (1, 51, 1, 40, 200, 64, 32), (1, 4, 2, 1500, 2300, 128, 128)])
def test_one_op_equals_the_stage_ops(dtype, per_block_mean, rotate, balance, search, b, hq, hk, sq, sk, d, pad):
    """preprocess_qkv (allocations and launches in C++, V first) gives the bits of the stage ops
    it replaces (quant_cols for V; smooth_quant_qk_key, or smooth_quant_seq for Q and then
    smooth_quant_seq_key for K), up to the most q heads per kv head the correction takes."""
    kernels_or_skip()
    from sageattn3 import _kernels

    q, k, v = qkv(b, hq, hk, sq, sk, d, dtype, seed=hq + sk, outliers=True)
    got = _kernels.preprocess_qkv(q, k, v, pad, per_block_mean, rotate, balance, search)
    vp, vsc, v_exp = _kernels.quant_cols(v, pad, exps=True)
    q3, k3 = q.view(b * hq, sq, d), k.view(b * hk, sk, d)
    if per_block_mean:
        qp, qsc, mean_q, kp, ksc, mean_k, qbar, ds_key, exps, k_res = _kernels.smooth_quant_qk_key(
            q3, k3, pad, rotate=rotate, balance=balance, search=search)
    else:
        qp, qsc, mean_q = _kernels.smooth_quant_seq(q3, pad, rotate=rotate, search=search)
        kp, ksc, mean_k, ds_key = _kernels.smooth_quant_seq_key(k3, pad, mean_q, rotate=rotate, search=search)
        qbar, exps = torch.empty(0, device="cuda"), torch.empty(0, device="cuda")
        k_res = torch.empty(0, dtype=torch.float16, device="cuda")
    if exps is None:
        exps = torch.empty(0, device="cuda")
    want = (qp, qsc, kp, ksc, vp, vsc, mean_q, mean_k, qbar, ds_key, exps, k_res, v_exp)
    sqp, skp = -(-sq // pad) * pad, -(-sk // pad) * pad
    shapes = [(b, hq, sqp, d // 2), (b, hq, sqp, d // 16), (b, hk, skp, d // 2), (b, hk, skp, d // 16),
              (b, hk, d, skp // 2), (b, hk, d, skp // 16), (b, hq, -(-sq // 128) if per_block_mean else 1, d),
              (b, hk, 1, d), (b if per_block_mean else 0, hq, 1, d), (b, hq, skp), (b if balance else 0, hk, 1, d),
              (b if per_block_mean else 0, hk, skp, d), (b, hk, -(-skp // 128), d // 32)]
    assert [tuple(t.shape) for t in got] == shapes
    for i, (a, w) in enumerate(zip(got, want)):
        w = w.view(torch.uint8) if w.dtype == torch.int8 else w
        assert a.dtype == w.dtype and a.numel() == w.numel() and same_bytes(a.reshape(-1), w.reshape(-1)), i
    if balance and sq >= 128 and sk >= 128:
        assert bool((got[10] != 0).any()), "outlier channels: some exponent is not 0"


def test_preprocess_qkv_rejects_bad_input():
    """A direct call with inputs the op cannot take is an error saying what to change."""
    kernels_or_skip()
    from sageattn3 import _kernels

    q = torch.randn(1, 4, 64, 128, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(1, 2, 64, 128, device="cuda", dtype=torch.bfloat16)
    run = _kernels.preprocess_qkv
    with pytest.raises(RuntimeError, match="head dim 64 or 128, got 48"):
        x = q[..., :48].contiguous()
        run(x, kv[..., :48].contiguous(), kv[..., :48].contiguous(), 128, True, False, False, False)
    with pytest.raises(RuntimeError, match="same dtype"):
        run(q, kv, kv.half(), 128, True, False, False, False)
    with pytest.raises(RuntimeError, match="multiple of kv heads"):
        run(q[:, :3].contiguous(), kv, kv, 128, True, False, False, False)
    with pytest.raises(RuntimeError, match="at most 25 per kv head"):
        run(q.repeat(1, 13, 1, 1), kv, kv, 128, True, False, False, False)
    with pytest.raises(RuntimeError, match=r"pad must be a positive multiple of 16 \(at most 2\^20\), got 24"):
        run(q, kv, kv, 24, True, False, False, False)
    with pytest.raises(RuntimeError, match="balance needs per_block_mean"):
        run(q, kv, kv, 128, False, False, True, False)
    with pytest.raises(RuntimeError, match="must not be empty"):
        run(q[:, :, :0], kv, kv, 128, True, False, False, False)
    with pytest.raises(RuntimeError, match=r"\(B, Hkv, Sk, D\)"):
        run(q, kv, kv[:, :, :5].contiguous(), 128, True, False, False, False)
    base = torch.empty(q.numel() + 8, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(RuntimeError, match="q must be 16-byte aligned"):
        run(base[1:q.numel() + 1].view(q.shape), kv, kv, 128, True, False, False, False)
    with pytest.raises(RuntimeError, match="k must be contiguous"):
        run(q, kv.transpose(2, 3), kv, 128, True, False, False, False)
    with pytest.raises(RuntimeError, match="v must be a CUDA tensor"):
        run(q, kv, kv.cpu(), 128, True, False, False, False)
    with pytest.raises(RuntimeError, match="must be 4-D"):
        run(q[0], kv[0], kv[0], 128, True, False, False, False)
    with pytest.raises(RuntimeError, match=r"\(B, Hkv, Sk, D\)"):
        run(q, kv[..., :64].contiguous(), kv[..., :64].contiguous(), 128, True, False, False, False)
    with pytest.raises(RuntimeError, match="must be float16, bfloat16 or float32"):
        run(q.to(torch.float64), kv, kv, 128, True, False, False, False)
    with pytest.raises(RuntimeError, match="multiple of kv heads"):
        run(q[:, :0], kv, kv, 128, True, False, False, False)
    torch.cuda.synchronize()


def test_preprocess_without_q_heads_and_outside_autograd():
    """sageattn3.preprocess with no q heads returns empty outputs (the reference); with inputs
    that require grad its outputs carry no grad_fn (they are data, as before the one op)."""
    sa = kernels_or_skip()
    q, k, v = qkv(1, 4, 2, 300, 300, 128, torch.bfloat16)
    pre = sa.preprocess(q[:, :0], k, v)
    assert pre.q_packed.shape[1] == 0 and pre.k_packed.shape == (1, 2, 384, 64)
    qg = q.clone().requires_grad_(True)
    pre = sa.preprocess(qg, k, v)
    for f in ("q_packed", "mean_q", "mean_k", "mean_q_global", "delta_key"):
        t = getattr(pre, f)
        assert not t.requires_grad and t.grad_fn is None, f
    want = sa.preprocess(q, k, v)
    assert same_bytes(pre.delta_key, want.delta_key) and same_bytes(pre.q_packed, want.q_packed)


@pytest.mark.parametrize("per_block_mean,balance", [(True, True), (True, False), (False, False)])
def test_preprocess_qkv_fake_matches_the_op(per_block_mean, balance):
    """The fake torch.compile traces with gives every output's shape, dtype and strides as the
    op does."""
    kernels_or_skip()
    from torch._subclasses.fake_tensor import FakeTensorMode
    from sageattn3 import _kernels

    q, k, v = qkv(2, 6, 3, 300, 129, 64, torch.float16)
    real = _kernels.preprocess_qkv(q, k, v, 128, per_block_mean, False, balance, False)
    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        fake = torch.ops.sageattn3.preprocess_qkv(fq, fk, fv, 128, per_block_mean, False, balance, False)
    assert len(fake) == len(real) == 13
    for a, b in zip(fake, real):
        assert (a.shape, a.dtype, a.stride(), a.device) == (b.shape, b.dtype, b.stride(), b.device)


def test_preprocess_qkv_under_graph_capture():
    """The one-op preprocessing (allocations and launches in C++) captured into a CUDA graph:
    replays give the bits of an eager call."""
    kernels_or_skip()
    from sageattn3 import _kernels

    q, k, v = qkv(1, 4, 2, 700, 900, 128, torch.bfloat16, seed=5, outliers=True)
    graph_replays_equal_eager(lambda: _kernels.preprocess_qkv(q, k, v, 128, True, False, True, False))


@pytest.mark.parametrize("search", [False, True])
def test_residual_of_nan_and_inf_k_blocks_matches_reference(search):
    """K holding a NaN and infinities: the NaN reaches its channel's mean, so that channel's block
    has a NaN scale in every row (codes 0, residual 0), and the infinities saturate their blocks'
    scales; K's codes, scales and residual bytes stay bit-exact with the reference."""
    sa = kernels_or_skip()
    from sageattn3 import reference as ref

    q, k, v = attention_cases.make("q_drift", 1, 4, 2, 300, 300, 128, seed=8)
    k = k.clone()
    k[0, 0, 5, 3] = float("nan")
    k[0, 1, 7, 40] = float("inf")
    k[0, 1, 9, 90] = float("-inf")
    pre = sa.preprocess(q.cuda(), k.cuda(), v.cuda(), qk_scale_search=search)
    exact = ref.preprocess(q, k, v, per_block_mean=True, mean_q=pre.mean_q.cpu(), mean_k=pre.mean_k.cpu(),
                           mean_q_global=pre.mean_q_global.cpu(), qk_scale_search=search)
    sbytes = pre.k_scales.view(torch.uint8).cpu()
    assert int((sbytes == 0x7F).sum()) >= 300 and int((sbytes == 0x7E).sum()) > 0  # NaN and saturated scales
    for name in ("k_packed", "k_scales", "k_residual"):
        assert same_bytes(getattr(pre, name), getattr(exact, name)), name


@pytest.mark.parametrize("search", [False, True])
def test_residual_of_zero_scale_blocks_matches_reference(search):
    """Tiny K (x0.003): many of K's blocks get scale byte 0 (codes 0; a quarter without the scale
    search, about a tenth with it, whose amax / 4 rounds to zero less often); their residual
    keeps the values in units of 2^-9 (reference.residual_scales), bit-exact with the reference
    like every other output."""
    sa = kernels_or_skip()
    from sageattn3 import reference as ref

    q, k, v = attention_cases.make("q_drift", 1, 4, 2, 700, 600, 128, seed=7, device="cuda")
    k = (k.float() * 0.003).to(k.dtype)
    pre = sa.preprocess(q, k, v, qk_balance=True, qk_scale_search=search)
    assert float((pre.k_scales.view(torch.uint8) == 0).float().mean()) > (0.05 if search else 0.25)
    assert bool((pre.k_residual.view(torch.int16) != 0).any())
    ref_default = ref.QK_SCALE_SEARCH
    ref.QK_SCALE_SEARCH = search
    try:
        _check_against_reference(pre, q, k, v, True, False, False, 2, 700, 128)
    finally:
        ref.QK_SCALE_SEARCH = ref_default
