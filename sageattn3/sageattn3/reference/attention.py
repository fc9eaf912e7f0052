"""The attention: exact (float64) attention, the quantized attention sageattn3 computes
(``sageattn3``, the kernel's definition) and SageAttention3 as published (``sageattn3_paper``)."""

from __future__ import annotations

import math

import torch

from .formats import (
    BLOCK,
    E4M3_MAX,
    FP4_MAX,
    MX_BLOCK,
    dequantize_qk_rows,
    mxfp8_p,
    dequantize_mxfp8_transposed,
    dequantize_rows,
    dequantize_transposed,
    dequantize_transposed_tiled,
    pad_dim,
    quantize_mxfp8_rows,
    quantize_rows,
)
from .precision import PV_PRECISION_DEFAULT, QK_PRECISION_DEFAULT, pv_precision_arg
from .treatments import treatment_applies, treatment_kwargs, treatment_names
from .preprocessing import Preprocessed, delta_s, preprocess, q_block_index
from .transforms import QK_BALANCE_DEFAULT, QK_ROTATION_DEFAULT, Q_MEAN_BLOCK, expand_kv, flag, rotation_score_factor

P_SCALE = E4M3_MAX * FP4_MAX  # 2688: where the row max of P is mapped (two-level quantization)
LOG2E = 1.4426950408889634


def exact_attention(q, k, v, is_causal: bool = False, sm_scale: float | None = None) -> torch.Tensor:
    """Plain float64 softmax attention, float32 result; GQA by expanding kv heads; causal =
    top-left aligned (key j visible to query i iff j <= i), like torch SDPA's ``is_causal``."""
    hq = q.shape[1]
    qd, kd, vd = q.double(), expand_kv(k.double(), hq), expand_kv(v.double(), hq)
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    s = torch.matmul(qd, kd.transpose(-1, -2)) * scale
    if is_causal:
        sq, sk = s.shape[-2:]
        mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), vd).float()


def _tiled_attention(qd, kd, vd, delta_rows, seq_k: int, is_causal: bool, c: float, block_n: int,
                     pv_fp8: bool = False) -> torch.Tensor:
    """The kernel's loop over key tiles (see ``sageattn3``): qd (B, Hq, Sq, D), kd/vd
    (B, Hq, Sk_p, D), delta_rows (B, Hq, Sq, Sk_p), c = softmax scale · log2(e). ``pv_fp8``: P
    and V in MXFP8 (vd then the dequantized MXFP8 V; block_n a multiple of 32): P = exp2(t - m)
    without the 2688 factor, ``quantize_mxfp8_rows`` along the keys (32-key blocks of the tile)."""
    b, hq, sq, d = qd.shape
    sk_p = kd.shape[-2]
    dev = qd.device
    rows = torch.arange(sq, device=dev).unsqueeze(-1)
    m = torch.full((b, hq, sq, 1), float("-inf"), device=dev)
    l = torch.zeros((b, hq, sq, 1), device=dev)
    acc = torch.zeros((b, hq, sq, d), device=dev)
    for j0 in range(0, sk_p, block_n):
        cols = torch.arange(j0, j0 + block_n, device=dev).unsqueeze(0)
        s = torch.matmul(qd, kd[..., j0 : j0 + block_n, :].transpose(-1, -2)) + delta_rows[..., j0 : j0 + block_n]
        t = s * c
        mask = cols >= seq_k
        if is_causal:
            mask = mask | (cols > rows)
        t = t.masked_fill(mask, float("-inf"))
        m_new = torch.maximum(m, t.amax(dim=-1, keepdim=True))
        live = torch.isfinite(m_new)  # rows with no visible key so far contribute nothing
        m_safe = torch.where(live, m_new, torch.zeros_like(m_new))
        alpha = torch.where(live, torch.exp2(m - m_safe), torch.zeros_like(m))
        if pv_fp8:
            p = torch.exp2(t - m_safe)
            p = torch.where(live, p, torch.zeros_like(p))
            ph = mxfp8_p(p)
        else:
            # the FP4 Q·Kᵀ kernels compute P / s per 16-key block as exp2(t - m + log2 2688 - log2 s)
            # and l from that times s: within 2^-18 ln 2 (2.6e-6) relative of this P at |m| = 100 (log2
            # units), growing with |m| (docs/performance.md, section 3's last part)
            p = torch.exp2(t - m_safe) * P_SCALE
            p = torch.where(live, p, torch.zeros_like(p))
            pp, psc = quantize_rows(p)
            ph = dequantize_rows(pp, psc)
        l = l * alpha + p.sum(dim=-1, keepdim=True)
        acc = acc * alpha + torch.matmul(ph, vd[..., j0 : j0 + block_n, :])
        m = m_new
    return acc / l


def _dequantized(pre: Preprocessed, hq: int, pv_fp8: bool = False):
    """Qd, Kd, Vd as the kernel multiplies them: per q head, Q and K in FP4, or in MXFP8 where
    pre.qk_fp8 says so; V in NVFP4, or in MXFP8 (pre.v8) with ``pv_fp8``."""
    sq = pre.seq_q
    qd = dequantize_rows(pre.q_packed, pre.q_scales)[..., :sq, :]
    kd = expand_kv(dequantize_rows(pre.k_packed, pre.k_scales), hq)
    if pre.qk_fp8 is not None:
        sel = pre.qk_fp8[:, :, None, None]
        qd = torch.where(sel, dequantize_qk_rows(pre.q8, pre.q8_scales)[..., :sq, :], qd)
        kd = torch.where(sel, expand_kv(dequantize_qk_rows(pre.k8, pre.k8_scales), hq), kd)
    if pv_fp8:
        vd = expand_kv(dequantize_mxfp8_transposed(pre.v8, pre.v8_scales, pre.v8.shape[-1]), hq)
    else:
        n = pre.v_packed.shape[-1] * 2
        vd = expand_kv(dequantize_transposed(pre.v_packed, pre.v_scales, n) if pre.v_exp is None else
                       dequantize_transposed_tiled(pre.v_packed, pre.v_scales, pre.v_exp, n), hq)
    return qd, kd, vd


def _delta_rows(pre: Preprocessed, sq: int) -> torch.Tensor:
    """delta_s per query row and key (B, Hq, Sq, Sk_p), with K's block correction when present."""
    delta = pre.delta_s
    rows = delta[..., q_block_index(sq, delta.shape[-2], delta.device), :]
    if pre.k_block_corr is not None:
        keys = torch.arange(rows.shape[-1], device=rows.device) // Q_MEAN_BLOCK
        rows = rows + pre.k_block_corr[..., keys.clamp(max=pre.k_block_corr.shape[-1] - 1)]
    return rows


def sageattn3(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    is_causal: bool = False,
    per_block_mean: bool = True,
    sm_scale: float | None = None,
    block_n: int = 128,
    qk_rotation: bool = QK_ROTATION_DEFAULT,
    qk_balance: bool = QK_BALANCE_DEFAULT,
    qk_scale_search: bool | None = None,
    qk_precision: str = QK_PRECISION_DEFAULT,
    k_block_mean: bool = False,
    pv_precision: str = PV_PRECISION_DEFAULT,
    qk_fp8_rotated: bool = True,
    pv_limit: float | None = None,
    v_tile_exponent: bool = True,
) -> torch.Tensor:
    """The quantized attention sageattn3 computes, float32 output (B, Hq, Sq, D).
    ``v_tile_exponent`` (the default, as the kernels do): V quantized with a power-of-two factor per
    tile of 128 keys and 32 channels (``preprocess``'s v_exp), so that V of any scale gives the same
    result; False: plain NVFP4 of V, the earlier path.

    ``qk_precision``: "auto" (the default) multiplies Q·Kᵀ of the heads the rule picks
    (``choose_qk_precision``, ``qk_fp4_error``) with MXFP8 operands (``quantize_mxfp8_rows`` of the
    same smoothed rows), the others in FP4; "fp4" every head in FP4 (the rule never runs), "fp8"
    every head in MXFP8 (P·V: ``pv_precision`` below). FP8 needs head dim 64/128 ("auto" keeps FP4 elsewhere);
    with ``qk_rotation`` the rule estimates on, and FP8 multiplies, the rotated rows. ``k_block_mean`` (reference only): K smoothed per 128-key block with the
    exact correction (``Preprocessed.k_block_corr``).

    With Qd, Kd, Vd the dequantized NVFP4 tensors of ``preprocess`` (rotated Q and K with
    ``qk_rotation`` at head dims 64/128; Q and K in the balanced space with ``qk_balance``,
    which leaves every score unchanged but moves FP4 error away from Q's and K's outlier channels; Q and
    K quantized with the scale search with ``qk_scale_search`` (None: ``QK_SCALE_SEARCH``, or on
    with ``qk_rotation``: ``scale_search_on``)) and
    c = sm_scale / rotation_score_factor · log2(e):

    - scores, per query row i and key j: t_ij = c · (Qd_i · Kd_j + delta_s[i // 128 or 0, j])
      with delta_s = ``Preprocessed.delta_s`` (delta_key_j + r_i · K̂_j) (float32; masked
      entries, j >= Sk or causal j > i, are -inf).
    - keys are processed in tiles of ``block_n`` (the kernel's tile, default 128). For tile t,
      the running row max m_t = max(m_{t-1}, max_{j in t} t_ij), and
      P_ij = exp2(t_ij - m_t) · 2688   (row max mapped to 448·6: the per-row factor exp2(-m_t)
      and the constant 2688, both folded into the exponent in the kernel),
      P̂ = NVFP4(P) along the keys (16-key blocks, the same quantizer as everything else),
      l_t = l_{t-1} · exp2(m_{t-1} - m_t) + Σ_j P_ij   (row sums of the unquantized P, in the
      same scaled domain),
      acc_t = acc_{t-1} · exp2(m_{t-1} - m_t) + P̂ · Vd_t.
    - O_i = acc / l.

    ``pv_precision="fp8"`` ("fp4" is the above; "auto", the default, picks per head below): P·V with
    MXFP8 operands, for the MMA ``kind::mxf8f6f4.block_scale.scale_vec::1X`` (E4M3 x E4M3, UE8M0
    scales, float32 accumulation), every head (any head dim; block_n a multiple of 32):

    - V̂ = ``quantize_mxfp8_transposed``(V) (``Preprocessed.v8``): E4M3 with one UE8M0 scale per
      channel and 32 consecutive keys (blocks aligned to key 0), dequantized Vd8.
    - in each tile, P_ij = exp2(t_ij - m_t), 0 where masked: the row max maps to 1, no 2688
      factor (P's per-block scales below are powers of two fitted to each block, so a constant
      factor would buy no range or precision; 2688, not a power of two, would only add a rounding);
      P̂ = ``quantize_mxfp8_rows``(P) along the keys: per row and 32-key block of the tile, the
      UE8M0 byte of the block's amax (``ue8m0_scale_byte``: the smallest power of two putting the
      amax at or below 448), P · 2^(127 - b) rounded to E4M3 (nearest even; nothing saturates:
      P <= 1); a block whose keys are all masked gets byte 1 and codes 0; a block holding a zero
      or subnormal code adds the MXFP8 of its residual (``mxfp8_p``, a second MMA in the kernel).
    - l_t = l_{t-1} · exp2(m_{t-1} - m_t) + Σ_j P_ij (unquantized P, this domain),
      acc_t = acc_{t-1} · exp2(m_{t-1} - m_t) + P̂ · Vd8_t; O_i = acc / l.

    Q·Kᵀ, the scores and the running max are exactly as with "fp4" (any ``qk_precision``).

    ``pv_precision="auto"`` (the default): where the Q·Kᵀ rule runs (``qk_precision`` "auto" or
    "fp8"), the heads whose P or V the rule finds too coarse (``pv_p_error`` above ``pv_limit``, None:
    ``PV_ERROR_LIMIT``; ``Preprocessed.pv_fp8``) take "fp8"'s P·V, the others "fp4"'s; elsewhere
    as "fp4". (The per-head choice reads ``pv_fp8.any()``: a host synchronisation on a GPU.)

    FP8 Q·Kᵀ ("fp8", or the heads "auto" picks) always multiplies rotated rows (D 64/128): with
    ``qk_rotation`` the MXFP8 of the rotated (and balanced) smoothed rows (``preprocess``); without
    it the balanced rows rotated, minus their rotated means, Q's times 64/D (``fp8_rows``), so the
    FP4 heads, delta_s and the softmax scale stay unrotated. The rotation spreads channels in
    which Q and K share outliers over every 32-channel block (Q and K outliers in the same
    channels: cos 0.93-0.95 unrotated, 0.99 rotated; docs/accuracy-auto.md). The kernels run it.
    ``qk_fp8_rotated=False`` (reference only): FP8 on the unrotated rows where ``qk_rotation`` is
    off, the path before this one, for comparison.
    """
    b, hq, sq, d = q.shape
    is_causal = flag(is_causal, "is_causal")
    pv_fp8 = pv_precision_arg(pv_precision) == "fp8"
    if block_n % BLOCK:
        raise ValueError("block_n must be a multiple of 16")
    if pv_fp8 and block_n % MX_BLOCK:
        raise ValueError(f"pv_precision='fp8' needs block_n to be a multiple of {MX_BLOCK}")
    pre = preprocess(q, k, v, per_block_mean, pad=block_n, qk_rotation=qk_rotation, qk_balance=qk_balance,
                     qk_scale_search=qk_scale_search, qk_precision=qk_precision, sm_scale=sm_scale,
                     k_block_mean=k_block_mean, pv_precision=pv_precision, qk_fp8_rotated=qk_fp8_rotated,
                     pv_limit=pv_limit, is_causal=is_causal, v_tile_exponent=v_tile_exponent)
    return _attend(pre, sm_scale, is_causal, block_n, pv_fp8)


def _attend(pre: Preprocessed, sm_scale: float | None, is_causal: bool, block_n: int, pv_fp8: bool) -> torch.Tensor:
    """``sageattn3``'s loop on preprocessed tensors: every head with ``pv_fp8``'s P·V, and where
    the rule gave heads FP8 P·V (``pre.pv_fp8``) those heads' output from the FP8 P·V loop."""
    hq, sq, d = pre.q_packed.shape[1], pre.seq_q, pre.q_packed.shape[-1] * 2
    qd, kd, vd = _dequantized(pre, hq, pv_fp8)
    ds_rows = _delta_rows(pre, sq)  # (B, Hq, Sq, Sk_p)
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    c = scale / rotation_score_factor(d, pre.qk_rotation) * LOG2E
    raw = pre.qk16 is not None and bool(pre.qk16.any())
    if raw:  # the raw 16-bit heads (pre.qk16): q·kᵀ of the inputs, no delta_s, unrotated scale
        sel = pre.qk16[:, :, None, None]
        qd = torch.where(sel, pre.q16.float(), qd)
        kd = torch.where(sel, expand_kv(pad_dim(pre.k16.float(), -2, kd.shape[-2]), hq), kd)
        ds_rows = torch.where(sel, torch.zeros_like(ds_rows), ds_rows)
        c = torch.where(sel, torch.tensor(scale * LOG2E, device=qd.device), torch.tensor(c, device=qd.device))
    out = _tiled_attention(qd, kd, vd, ds_rows, pre.seq_k, is_causal, c, block_n, pv_fp8)
    if pre.pv_fp8 is None or not bool(pre.pv_fp8.any()):
        return out
    vd8 = _dequantized(pre, hq, True)[2]
    out8 = _tiled_attention(qd, kd, vd8, ds_rows, pre.seq_k, is_causal, c, block_n, True)
    return torch.where(pre.pv_fp8[:, :, None, None], out8, out)


def sageattn3_paper(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    is_causal: bool = False,
    per_block_mean: bool = True,
    sm_scale: float | None = None,
    block_n: int = 128,
) -> torch.Tensor:
    """SageAttention3 as published, for comparison (the accuracy table): no rotation, no balance,
    K's mean (and Q's without per_block_mean) over the whole sequence, and the correction
    delta_s = mean_q · K_sᵀ with the unquantized smoothed K materialised for every (Q block, key)
    pair; otherwise the same quantizers and online softmax as ``sageattn3``."""
    b, hq, sq, d = q.shape
    is_causal, per_block_mean = flag(is_causal, "is_causal"), flag(per_block_mean, "per_block_mean")
    full_q = None if per_block_mean else q.float().mean(dim=-2, keepdim=True)
    pre = preprocess(q, k, v, per_block_mean, pad=block_n, mean_q=full_q, mean_k=k.float().mean(dim=-2, keepdim=True),
                     qk_rotation=False, qk_balance=False, qk_scale_search=False)
    qd, kd, vd = _dequantized(pre, hq)
    ks = pad_dim(k.float() - pre.mean_k, -2, block_n)
    delta = delta_s(pre.mean_q, ks)
    ds_rows = delta[..., q_block_index(sq, delta.shape[-2], q.device), :]
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    return _tiled_attention(qd, kd, vd, ds_rows, k.shape[-2], is_causal, scale * LOG2E, block_n)


def cosine_similarity(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float((a @ b) / (a.norm() * b.norm()).clamp_min(1e-300))


def sageattn3_treated(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    treatments,
    is_causal: bool = False,
    per_block_mean: bool = True,
    sm_scale: float | None = None,
    block_n: int = 128,
) -> torch.Tensor:
    """The quantized attention with a treatment set per q head (reference only, opt-in):
    ``treatments`` an int (every head) or a (B, Hq) integer tensor of sets
    (``treatments.TREATMENTS`` bits: balance, rotation, scale search, FP8 Q·Kᵀ, FP8 P·V), e.g.
    from ``choose_treatments``. Head h's output is ``sageattn3``'s with set h's keywords
    (``treatment_kwargs``) on every head: heads are independent, and a kv head whose q heads
    differ is quantized once per set (what kernels would do per set of heads). Sets that do not
    apply (``treatment_applies``) raise."""
    b, hq, d = q.shape[0], q.shape[1], q.shape[-1]
    sel = torch.as_tensor(treatments, device=q.device).to(torch.int64).expand(b, hq)
    out = None
    for s in sorted(set(sel.flatten().tolist())):
        if not treatment_applies(s, d, per_block_mean):
            raise ValueError(f"treatment set {s} ({', '.join(treatment_names(s))}) does not apply at head_dim {d}"
                             f"{'' if per_block_mean else ' without per_block_mean'}")
        o = sageattn3(q, k, v, is_causal=is_causal, per_block_mean=per_block_mean, sm_scale=sm_scale,
                      block_n=block_n, **treatment_kwargs(s))
        out = o if out is None else torch.where((sel == s)[:, :, None, None], o, out)
    return out
