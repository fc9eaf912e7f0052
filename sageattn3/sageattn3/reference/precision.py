"""The Q·Kᵀ precision per head: FP4, or MXFP8 where the rule ("auto") estimates that FP4 Q·Kᵀ
costs the output too much (``qk_fp4_error``, ``choose_qk_precision``; at D 128 the raw 16-bit rows
where ``qk16_stat`` says MXFP8 is not enough), and the P·V precision (``pv_p_error``). The
treatments per head (opt-in, reference only) are in ``treatments``.

The rule reads a ``preprocessing.Preprocessed`` (its quantized Q and K, means and balance) and
is called by ``preprocess``: it sits below the preprocessing and names no type of it.
"""

from __future__ import annotations

import math

import torch

from sageattn3 import reference as _package  # the knobs (AUTO_QUERY_STRIDE, AUTO_ERROR_LIMIT), read per call

from .formats import (
    BLOCK,
    E4M3_MAX,
    FP4_MAX,
    QK16_RAW_HEAD_DIM,
    V_GROUP,
    dequantize_rows,
    dequantize_transposed,
    e4m3_decode,
    quantize_rows,
    unpack_codes,
)
from .transforms import (
    Q_MEAN_BLOCK,
    expand_kv,
    flag,
    rotate,
    rotation_score_factor,
    sample_blocks,
    unrotate,
)

QK_PRECISIONS = ("fp4", "fp8", "auto")
QK_PRECISION_DEFAULT = "auto"
FP8_HEAD_DIMS = (64, 128)
# Standard errors of the sampled ratio that ``qk_fp4_error`` adds (``spread_bound``; the rule
# kernel's kSpreadZ: a constant of the build, not one of the package's knobs, so it is not exported
# there). A head whose FP4 error sits on a few of its rows (near a key of huge norm, or low-rank Q
# and K) varies most between samples: at every 4th or 8th row the plain ratio put such heads at
# 0.09-0.2 that land at cos 0.95-0.98 against exact attention; the bound lifts most of them over
# AUTO_ERROR_LIMIT, while zero-mean heads, whose rows agree, stay below it (docs/accuracy-auto-details.md,
# "The spread of the rows").
AUTO_ERROR_SPREAD = 3.0
PV_CHUNK = 32  # keys per running-max step of ``pv_p_error`` (the rule kernel's staged chunk)
# V's part of ``pv_p_error`` counts against PV_ERROR_LIMIT times this (the rule kernel's kVFactor: a
# constant of the build, as AUTO_ERROR_SPREAD). NVFP4 V's own error, e_V, is 0.008-0.131 on every other case of
# tests/attention_cases.py (its blocks' rounding, the same for every head: zero-mean heads 0.09-0.11),
# and 0.43-1.0 where a key that takes most of a row's P has a V row small beside its 16-key block's
# (attention sinks whose V is 1/10 or less of the other keys': cos-sim 0.06-0.92 with NVFP4 V, 0.99
# with MXFP8; docs/accuracy-auto-details.md, "V's share of the P·V estimate", with what it misses).
PV_V_FACTOR = 1.5
# P·V: "auto" (the default: NVFP4 P·V, P two-level NVFP4 and V NVFP4 along the sequence, but MXFP8
# for the heads whose P or V the rule finds too coarse: ``pv_p_error``, ``choose_pv_precision``), "fp4"
# (NVFP4 for every head) or "fp8" (P and V in MXFP8 for every head: ``reference.sageattn3``).
PV_PRECISIONS = ("fp4", "fp8", "auto")
PV_PRECISION_DEFAULT = "auto"


def qk_precision_arg(value) -> str:
    """Checks a ``qk_precision`` argument: one of "fp4", "fp8", "auto"."""
    if not isinstance(value, str) or value not in QK_PRECISIONS:
        raise ValueError(f"qk_precision must be one of {', '.join(map(repr, QK_PRECISIONS))}, got {value!r}")
    return value


def pv_precision_arg(value) -> str:
    """Checks a ``pv_precision`` argument: one of "fp4", "fp8", "auto"."""
    if not isinstance(value, str) or value not in PV_PRECISIONS:
        raise ValueError(f"pv_precision must be one of {', '.join(map(repr, PV_PRECISIONS))}, got {value!r}")
    return value


def fp8_applies(rotated: bool, head_dim: int) -> bool:
    """FP8 Q·Kᵀ ("fp8", or picked per head by "auto") exists at head dims 64/128, with or without
    the Q/K rotation (with it, on the rotated rows, and the rule estimates on those rows too).
    ``rotated`` is kept for the callers' sake: it no longer changes the answer."""
    del rotated
    return head_dim in FP8_HEAD_DIMS


def fp8_unavailable(rotated: bool, head_dim: int) -> str:
    del rotated
    return f"qk_precision='fp8' needs head_dim 64 or 128, got {head_dim}; use qk_precision='fp4' or 'auto'"


def _sampled_rows(x: torch.Tensor, seq: int, stride: int) -> list[torch.Tensor]:
    """Every ``stride``-th real row of each sampled 128-row block of x (..., S_or_padded, D), as
    views, block by block (no host data reaches the device: slicing only)."""
    return [x[..., t * Q_MEAN_BLOCK : min(seq, (t + 1) * Q_MEAN_BLOCK) : stride, :] for t in sample_blocks(seq)]


def _mean_rows(means: torch.Tensor, seq: int, stride: int) -> torch.Tensor:
    """The Q mean (B, H, nblk, D) of every row ``_sampled_rows`` takes, stacked like them."""
    nm = means.shape[-2]
    parts = []
    for t in sample_blocks(seq):
        rows = len(range(t * Q_MEAN_BLOCK, min(seq, (t + 1) * Q_MEAN_BLOCK), stride))
        i = t if nm > 1 else 0
        parts.append(means[..., i:i + 1, :].expand(*means.shape[:-2], rows, means.shape[-1]))
    return torch.cat(parts, dim=-2)


def _sampled_count(seq: int, stride: int) -> int:
    """How many rows ``_sampled_rows`` takes at ``stride``."""
    return sum(len(range(t * Q_MEAN_BLOCK, min(seq, (t + 1) * Q_MEAN_BLOCK), stride)) for t in sample_blocks(seq))


def query_stride(sq: int, sk: int) -> int:
    """The stride of the rule's query rows in a call of ``sq`` queries and ``sk`` keys, from the
    shapes alone: the smallest of 1, 2, 4, ... below ``AUTO_QUERY_STRIDE`` at which the sampled
    rows times the sampled keys stay within 1.5 times a long call's (``MEAN_SAMPLE_BLOCKS`` blocks
    of 128 / ``AUTO_QUERY_STRIDE`` rows against as many blocks of 128 keys: 1.5 x 128 x 1024),
    else ``AUTO_QUERY_STRIDE``. A short call reads every row (up to 443 tokens), every 2nd (up to
    626) or every 4th (up to 885): on a near-one-hot head of a few hundred rows, FP4's error sits on
    the few rows whose top two scores are close, which every 8th row can miss. 1.5 keeps every call
    of more than 1024 tokens at ``AUTO_QUERY_STRIDE`` (2 would read every 4th row of them all)."""
    stride = _package.AUTO_QUERY_STRIDE
    budget = (_package.MEAN_SAMPLE_BLOCKS * Q_MEAN_BLOCK) ** 2 // stride * 3 // 2
    keys = _sampled_count(sk, 1)
    s = 1
    while s < stride:
        if _sampled_count(sq, s) * keys <= budget:
            return s
        s *= 2
    return stride


def _e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes -> float32 by arithmetic (no table: nothing copied from the host)."""
    m = (codes & 7).to(torch.float32)
    big = torch.exp2(torch.floor(m * 0.5) - 1.0) * (1.0 + 0.5 * (codes & 1).to(torch.float32))
    mag = torch.where(m < 4, m * 0.5, big)
    return torch.where((codes & 8) != 0, -mag, mag)


def _dequantize_fp4_rows(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    vals = _e2m1_values(unpack_codes(packed))
    n = vals.shape[-1]
    s = e4m3_decode(scales)
    return (vals.reshape(*vals.shape[:-1], n // BLOCK, BLOCK) * s.unsqueeze(-1)).reshape(vals.shape)


def qk_fp4_error(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pre,
                 sm_scale: float | None = None) -> torch.Tensor:
    """The rule's estimate, per q head, of the relative output error FP4 Q·Kᵀ causes: (B, Hq)
    float32, computed with torch ops on q's device (no host synchronisation, no host data).
    ``pre``: the ``Preprocessed`` that ``preprocess`` made of q, k, v.

    1. Query rows: every s-th row of Q's sampled 128-row blocks (``sample_blocks``; s =
       ``query_stride``: ``AUTO_QUERY_STRIDE`` on long calls, down to 1 on short ones), smoothed
       as the preprocessing smoothed them (balanced, rotated where ``pre.qk_rotation``, minus
       their block's mean: Q_s), and the same rows of the FP4 Q the kernel reads (Qd,
       dequantized).
    2. Keys: every row of K's sampled blocks, K_s (balanced, rotated, minus mean_k) and Kd
       likewise; V's same rows.
    3. L = c · Q_s K_sᵀ and L4 = c · Qd Kdᵀ with c the softmax scale (default 1/sqrt(D)), divided
       by D/64 on rotated rows (``rotation_score_factor``); O = softmax(L) V and O4 = softmax(L4) V
       (no mask: a statistic of the head).
    4. error = sqrt(r + z · se): r = ||O4 - O||² / ||O||² over the head's sampled rows (Frobenius
       norms), se the standard error of r as an estimate of the same ratio over all the head's rows
       (from how much the sampled rows' terms differ; 0 where every row is read) and z =
       ``AUTO_ERROR_SPREAD`` (``spread_bound``): a head whose error sits on a few rows, which a
       sample of every 4th or 8th row may under-count, leaves FP4 on the doubt.
    5. Options are floors: where ``pre`` has the balance, the rotation or the scale search
       (``rule_has_options``), the estimate is the larger (NaN if either is) of step 4's and the
       same estimate for the defaults' rows: Q and K minus ``options_free_means(pre)``, with their
       own NVFP4 codes (``quantize_rows``, plain scales). A head the defaults would give FP8 keeps
       it whatever the options.

    Only Q·Kᵀ's FP4 error enters (the correction delta_s is the same in both and cancels); the
    error of P·V, which FP8 Q·Kᵀ would not change, does not. Heads whose scores span a wide
    range (near-one-hot rows), whose keys keep a large component after smoothing (biases that
    rotary embeddings turn with the position) or whose channels have outliers come out large."""
    if pre.k_block_corr is not None:
        raise ValueError("qk_fp4_error: K's per-block means (k_block_mean) are not part of the rule")
    err = _fp4_error(q, k, v, pre, sm_scale, plain=False)
    if rule_has_options(pre):
        err = torch.maximum(err, _fp4_error(q, k, v, pre, sm_scale, plain=True))
    return err


def rule_has_options(pre) -> bool:
    """Whether ``pre`` was made with an option that changes Q's and K's FP4 rows (the balance, the
    rotation, the scale search): the rule then also estimates the defaults' rows."""
    return bool(pre.qk_rotation) or pre.balance is not None or bool(pre.qk_scale_search)


def options_free_means(pre) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean_q, mean_k) of ``pre`` taken back to the space without the balance and the rotation:
    ``unrotate``, then the balance's powers of two undone (Q's times 2^e, K's times 2^-e). Float32
    elementwise operations in a fixed order (the kernels' path runs this same function)."""
    mq, mk = pre.mean_q.float(), pre.mean_k.float()
    if pre.qk_rotation:
        mq, mk = unrotate(mq), unrotate(mk)
    if pre.balance is not None:
        mq = mq * expand_kv(torch.exp2(pre.balance), mq.shape[1])
        mk = mk * torch.exp2(-pre.balance)
    return mq, mk


def _fp4_error(q, k, v, pre, sm_scale, plain: bool) -> torch.Tensor:
    """Steps 1-4 of ``qk_fp4_error`` on the rows ``pre`` quantized (plain=False) or on the
    defaults' rows quantized here (plain=True)."""
    b, hq, sq, d = q.shape
    sk = k.shape[2]
    rotated = pre.qk_rotation and not plain
    scale = (sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)) / rotation_score_factor(d, rotated)
    turn = rotate if rotated else (lambda x: x)
    bal = None if plain else pre.balance
    cq = 1.0 if bal is None else expand_kv(torch.exp2(-bal), hq)
    ck = 1.0 if bal is None else torch.exp2(bal)
    mean_q, mean_k = options_free_means(pre) if plain else (pre.mean_q, pre.mean_k)
    cat = lambda views: torch.cat(views, dim=-2)  # noqa: E731  (one gather per operand)
    stride = query_stride(sq, sk)
    q_rows = _sampled_rows(q, sq, stride)
    qs = turn(cat(q_rows).float() * cq) - _mean_rows(mean_q, sq, stride)
    ks = turn(cat(_sampled_rows(k, sk, 1)).float() * ck) - mean_k
    if plain:
        qd, kd = _dequantize_fp4_rows(*quantize_rows(qs)), _dequantize_fp4_rows(*quantize_rows(ks))
    else:
        qd = _dequantize_fp4_rows(cat(_sampled_rows(pre.q_packed, sq, stride)),
                                  cat(_sampled_rows(pre.q_scales, sq, stride)))
        kd = _dequantize_fp4_rows(cat(_sampled_rows(pre.k_packed, sk, 1)), cat(_sampled_rows(pre.k_scales, sk, 1)))
    vs = cat(_sampled_rows(v, sk, 1)).float()
    ks, kd, vs = expand_kv(ks, hq), expand_kv(kd, hq), expand_kv(vs, hq)
    o = torch.matmul(torch.softmax(torch.matmul(qs, ks.transpose(-1, -2)) * scale, dim=-1), vs)
    o4 = torch.matmul(torch.softmax(torch.matmul(qd, kd.transpose(-1, -2)) * scale, dim=-1), vs)
    return spread_bound((o4 - o).square().sum(dim=-1), o.square().sum(dim=-1), sq)


def spread_bound(num_rows: torch.Tensor, den_rows: torch.Tensor, seq: int) -> torch.Tensor:
    """Step 4 of ``qk_fp4_error`` from each sampled row's n_r = ||O4_r - O_r||² and d_r = ||O_r||²
    (..., rows) of a head of ``seq`` query rows: sqrt(r + z · se), r = Σ n_r / Σ d_r (float32 sums,
    d clamped at 1e-30), se the standard error of that ratio over the sample,
    sqrt(Σ (n_r - r d_r)² · rows / (rows - 1) · (1 - rows / seq)) / Σ d_r (from the float64 sums of
    n_r², d_r² and n_r d_r, so the spread stays scale-invariant where those squares would leave
    float32's range, |V| below about 1e-11 or above about 1e8; 1 - rows / seq the finite-population
    factor: 0 where every row is read, so is the spread), z = ``AUTO_ERROR_SPREAD``, combined in
    float64 (the rule kernel's spread_bound). The plain sqrt(r) with fewer than 2 rows, Σ d_r = 0,
    z = 0, or where the combination is not finite (the float32 row terms themselves out of range)."""
    n, d = num_rows.sum(dim=-1), den_rows.sum(dim=-1)
    r = n / d.clamp_min(1e-30)
    rows = num_rows.shape[-1]
    if rows < 2 or rows >= seq or AUTO_ERROR_SPREAD == 0:
        return torch.sqrt(r)
    nr, dr = num_rows.double(), den_rows.double()
    snn, sdd, snd = (nr * nr).sum(-1), (dr * dr).sum(-1), (nr * dr).sum(-1)
    rr = r.double()
    res = snn - 2.0 * rr * snd + rr * rr * sdd
    se = torch.sqrt(res.clamp_min(0.0) * rows / (rows - 1) * (1.0 - rows / seq)) / d.double()
    bound = torch.sqrt(rr + AUTO_ERROR_SPREAD * se)
    ok = (d > 0) & torch.isfinite(res) & torch.isfinite(bound)
    return torch.where(ok, bound.float(), torch.sqrt(r))


def qk16_stat(q: torch.Tensor, k: torch.Tensor, pre, sm_scale: float | None = None) -> torch.Tensor:
    """The rule's second statistic, per q head: (B, Hq) float32, the scale of the logit error
    MXFP8 Q·Kᵀ would leave, c · sqrt(mean |q - w|^2) · sqrt(mean |k - w_k|^2) / sqrt(D) over the
    rule's sample (``qk_fp4_error``'s rows: every s-th row of Q's sampled blocks, minus their
    block's options-free mean w; the rows of K's first sampled block, minus K's options-free mean
    w_k; ``options_free_means``), c the unrotated softmax scale (default 1/sqrt(D)). MXFP8 keeps 4
    significant bits an element and the rotation spreads a row's norm over its channels, so its
    error on a score grows with the product of the two rows' norms: where this is large (massive
    outliers shared by Q and K: 35.9-48.3 against at most 10.7 on every other case of
    tests/attention_cases.py at D 128), even MXFP8 moves the scores by logits. Sums of squares in float32 (the rule kernel's, up to order)."""
    b, hq, sq, d = q.shape
    sk = k.shape[2]
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    mean_q, mean_k = options_free_means(pre)
    stride = query_stride(sq, sk)
    qs = torch.cat(_sampled_rows(q, sq, stride), dim=-2).float() - _mean_rows(mean_q, sq, stride)
    ks = _sampled_rows(k, sk, 1)[0].float() - mean_k.float()  # K's first sampled block
    q2 = qs.square().sum(dim=(-1, -2)) / qs.shape[-2]
    k2 = expand_kv(ks.square().sum(dim=(-1, -2)).unsqueeze(-1).unsqueeze(-1) / ks.shape[-2], hq)[..., 0, 0]
    return (scale * torch.sqrt(q2 * k2 / d)).float()


def choose_qk16(qk_fp8: torch.Tensor, stat: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(B, Hq) bool, True where a head that leaves FP4 (``qk_fp8``) multiplies its raw 16-bit
    rows instead of MXFP8 (D 128 only; at D 64 the precise rung is 16-bit already): ``qk16_stat``
    above ``QK16_STAT_LIMIT`` (a NaN keeps MXFP8)."""
    limit = _package.QK16_STAT_LIMIT
    if head_dim != QK16_RAW_HEAD_DIM or not limit >= 0:  # a negative (or NaN) limit: off, as the kernels
        return torch.zeros_like(qk_fp8)
    return qk_fp8 & (stat > limit)


def rule_limit(sq: int) -> float:
    """The limit "auto" compares each head's ``qk_fp4_error`` with on a call of ``sq`` query rows:
    ``AUTO_ERROR_LIMIT``, or -1 (every head leaves FP4) where ``1 < sq < AUTO_SHORT_QUERY_ROWS``.
    The kernels' rule takes the same number (``qk_rule_select``'s and ``attention_call``'s limit)."""
    return -1.0 if 1 < sq < _package.AUTO_SHORT_QUERY_ROWS else float(_package.AUTO_ERROR_LIMIT)


def choose_qk_precision(precision: str, error: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """(B, Hq) bool, True where a q head's Q·Kᵀ runs in FP8: "fp8" every head, "fp4" none,
    "auto" the heads whose ``qk_fp4_error`` exceeds ``limit`` (``rule_limit`` of the call; None:
    ``AUTO_ERROR_LIMIT``); a NaN estimate, from NaN inputs, keeps FP4."""
    precision = qk_precision_arg(precision)
    if precision == "auto":
        return error > (_package.AUTO_ERROR_LIMIT if limit is None else limit)
    return torch.full_like(error, precision == "fp8", dtype=torch.bool)



def pv_p_error(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pre, sm_scale: float | None = None,
               is_causal: bool = False) -> torch.Tensor:
    """The rule's estimate, per q head, of the relative output error NVFP4 P·V causes (P's, or V's share
    over ``PV_V_FACTOR``): (B, Hq) float32,
    torch ops on q's device (the oracle of the rule kernel's P blocks, csrc/preprocess/qk_rule.cu).
    The rows and keys of ``qk_fp4_error``'s first estimate (``pre``'s balanced, rotated rows), but Q
    whole (its mean not removed: the scores then differ from the attention's only by a constant per
    row, so P's peaks are the attention's):

    1. L = c · Q K_sᵀ (c the softmax scale over ``rotation_score_factor``), every sampled key; with
       ``is_causal`` a sampled key after the sampled row's position is masked (-inf), as the attention
       masks it (key 0 is always sampled and seen, so every row keeps a finite max from its first
       chunk on).
    2. The keys in chunks of 32 (the sampled blocks' chunks; a partial last block's tail -inf);
       per chunk the running max m_c (the max of L over the chunks so far); P = e^(L - m_c) · 2688,
       NVFP4 along the keys (16-key blocks, ``quantize_rows``) and / 2688: P̂.
    3. O = softmax(L) V; O_P = Σ_c e^(m_c - m_last) P̂_c V_c / Σ e^(L - m_last) (V exact).
    4. e_P = ||O_P - O|| / ||O|| over the head's sampled rows.
    5. V's share: e_V = sqrt(Σ_r Σ_j P_rj² ε_j / Σ_r ||O_r||²), P = softmax(L) (exact), ε_j =
       ||V̂_j - V_j||² over the channels, V̂ the attention's NVFP4 V (``pre``'s v_packed, v_scales
       and v_exp, dequantized): the error V̂ gives O where the keys' errors are independent,
       exactly so where one key takes a row's P.
    6. error = max(e_P, e_V / ``PV_V_FACTOR``) (NaN if either is).

    Peaky rows whose other keys carry the output (large logits: a sink takes the row max and the
    rest sit at e^-10 of it) lose the most to P: most of their P falls below a 16-key block's
    smallest FP4 step. V's rounding alone (e_V about 0.1 on zero-mean data, as large as P's error on
    those rows) does not tell them apart, hence its factor; what it catches is a key that takes a
    row's P with a V row small beside the others of its 16-key block (an attention sink whose V is
    small), which NVFP4 V rounds to zero. The mask matters for causal calls: there the early
    rows see few keys besides a sink, so a peaky head's P loses more than the whole rows show, and
    a zero-mean head's less (docs/accuracy-auto.md, "The P·V choice")."""
    b, hq, sq, d = q.shape
    sk = k.shape[2]
    scale = (sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)) / rotation_score_factor(d, pre.qk_rotation)
    turn = rotate if pre.qk_rotation else (lambda x: x)
    cq = 1.0 if pre.balance is None else expand_kv(torch.exp2(-pre.balance), hq)
    ck = 1.0 if pre.balance is None else torch.exp2(pre.balance)
    cat = lambda views: torch.cat(views, dim=-2)  # noqa: E731
    stride = query_stride(sq, sk)
    qs = turn(cat(_sampled_rows(q, sq, stride)).float() * cq)
    ks = expand_kv(turn(cat(_sampled_rows(k, sk, 1)).float() * ck) - pre.mean_k, hq)
    vs = expand_kv(cat(_sampled_rows(v, sk, 1)).float(), hq)
    lg = torch.matmul(qs, ks.transpose(-1, -2)) * scale
    if flag(is_causal, "is_causal"):
        masked = _sampled_positions(sk, 1, q.device)[None, :] > _sampled_positions(sq, stride, q.device)[:, None]
        lg = lg.masked_fill(masked, float("-inf"))
    p_exact = torch.softmax(lg, dim=-1)
    o = torch.matmul(p_exact, vs)
    n = lg.shape[-1]
    nc = -(-n // PV_CHUNK)
    chunks = torch.nn.functional.pad(lg, (0, nc * PV_CHUNK - n), value=float("-inf")).unflatten(-1, (nc, PV_CHUNK))
    run = torch.cummax(chunks.amax(dim=-1), dim=-1).values  # (B, Hq, R, nc)
    p = torch.exp(chunks - run.unsqueeze(-1)) * (E4M3_MAX * FP4_MAX)
    ph = dequantize_rows(*quantize_rows(p.flatten(-2))).unflatten(-1, (nc, PV_CHUNK)) / (E4M3_MAX * FP4_MAX)
    last = run[..., -1:]
    ph = (ph * torch.exp(run - last).unsqueeze(-1)).flatten(-2)[..., :n]
    o_p = torch.matmul(ph, vs) / torch.exp(lg - last).sum(dim=-1, keepdim=True)
    num = (o_p - o).square().sum(dim=(-1, -2))
    den = o.square().sum(dim=(-1, -2)).clamp_min(1e-30)
    vh = expand_kv(_sampled_v_hat(pre, sk), hq)
    eps = (vh - vs).square().sum(dim=-1)  # (B, Hq, keys)
    num_v = (p_exact.square() * eps.unsqueeze(-2)).sum(dim=(-1, -2))
    return torch.maximum(torch.sqrt(num / den), torch.sqrt(num_v / den) / PV_V_FACTOR)


def _sampled_v_hat(pre, seq: int) -> torch.Tensor:
    """V as the attention's NVFP4 P·V multiplies it, on the rows ``_sampled_rows(v, seq, 1)`` takes:
    ``pre``'s v_packed and v_scales of each sampled 128-key block dequantized (times 2^-e of its tile,
    v_exp, where set), (B, Hkv, rows, D) float32. Only the sampled blocks are decoded."""
    blocks = []
    for t in sample_blocks(seq):
        x = dequantize_transposed(pre.v_packed[..., t * 64:(t + 1) * 64], pre.v_scales[..., t * 8:(t + 1) * 8],
                                  Q_MEAN_BLOCK)
        if pre.v_exp is not None:
            x = x * torch.exp2(-pre.v_exp[..., t, :].float()).repeat_interleave(V_GROUP, dim=-1).unsqueeze(-2)
        blocks.append(x[..., : min(seq, (t + 1) * Q_MEAN_BLOCK) - t * Q_MEAN_BLOCK, :])
    return torch.cat(blocks, dim=-2)


def choose_pv_precision(precision: str, error: torch.Tensor | None, limit: float | None = None) -> torch.Tensor | None:
    """(B, Hq) bool, True where a q head's P·V runs in MXFP8, for ``pv_precision`` "auto" (the heads
    whose ``pv_p_error`` exceeds ``limit``, None: ``PV_ERROR_LIMIT``; a NaN estimate keeps FP4); None
    for "fp4" and "fp8" (every head the same) and where the rule did not run (``error`` None)."""
    if pv_precision_arg(precision) != "auto" or error is None:
        return None
    return error > (_package.PV_ERROR_LIMIT if limit is None else limit)


def _sampled_positions(seq: int, stride: int, device=None) -> torch.Tensor:
    """The sequence positions of the rows ``_sampled_rows`` takes, in their order."""
    return torch.cat([torch.arange(t * Q_MEAN_BLOCK, min(seq, (t + 1) * Q_MEAN_BLOCK), stride, device=device)
                      for t in sample_blocks(seq)])
