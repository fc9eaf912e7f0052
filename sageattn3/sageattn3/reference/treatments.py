"""Treatments per head (opt-in, reference only: not wired into any default): the estimate of
every treatment set's output error per head (``treatment_errors``) and the choice of the cheapest
set meeting the target (``choose_treatments``), the balance, the rotation, the scale search, FP8
Q·Kᵀ and FP8 P·V as bits of a set."""

from __future__ import annotations

import math

import torch

from sageattn3 import reference as _package  # the knobs (TREATMENT_ERROR_LIMIT, ...), read per call

from .formats import (
    E4M3_MAX,
    FP4_MAX,
    MX_BLOCK,
    QK16_HEAD_DIM,
    QK16_RAW_HEAD_DIM,
    V_GROUP,
    dequantize_mxfp8_rows,
    dequantize_mxfp8_transposed,
    dequantize_rows,
    dequantize_transposed,
    dequantize_transposed_tiled,
    mxfp8_p,
    pad_dim,
    qk16_rows,
    quantize_mxfp8_rows,
    quantize_mxfp8_transposed,
    quantize_rows,
    quantize_transposed,
    quantize_transposed_tiled,
)
from .precision import FP8_HEAD_DIMS, _mean_rows, _sampled_positions, _sampled_rows, qk16_stat, query_stride
from .transforms import balance_exponents, expand_kv, rotate, rotation_score_factor


# The treatments a head may get, one bit each; a treatment set is an int 0..31 (0: plain FP4,
# today's path with qk_precision="fp4"). The bits double as the cost: a set costs its int value,
# so the cheapest set meeting the target is the smallest int. The order (balance < rotation <
# scale search < FP8 Q·Kᵀ < FP8 P·V) follows the measured costs: the balance +5% of the
# preprocessing, the rotation +45%, the scale search +85% (the preprocessing is ~1% of a long
# call), FP8 Q·Kᵀ +25% of the attention kernel (its Q·Kᵀ MMAs doubled), FP8 P·V its P·V MMAs
# doubled plus a 32-key amax and an E4M3 conversion of P per tile and twice V's bytes; with
# power-of-two weights any set of cheaper treatments costs less than one dearer treatment.
TREATMENTS = ("balance", "rotation", "scale_search", "qk_fp8", "pv_fp8")
BALANCE, ROTATION, SCALE_SEARCH, QK_FP8, PV_FP8 = (1 << i for i in range(len(TREATMENTS)))
TREATMENT_SETS = 1 << len(TREATMENTS)


def treatment_names(s: int) -> tuple[str, ...]:
    """The treatments of set ``s`` (int), in TREATMENTS order; () for plain FP4."""
    return tuple(n for i, n in enumerate(TREATMENTS) if (int(s) >> i) & 1)


def treatment_set(names) -> int:
    """The set (int) of an iterable of TREATMENTS names."""
    s = 0
    for n in names:
        if n not in TREATMENTS:
            raise ValueError(f"unknown treatment {n!r}: one of {', '.join(TREATMENTS)}")
        s |= 1 << TREATMENTS.index(n)
    return s


def treatment_kwargs(s: int) -> dict:
    """The keywords of ``reference.sageattn3`` that give set ``s`` on every head (qk_precision
    "fp4" or "fp8", never "auto"; qk_fp8_rotated with FP8 Q·Kᵀ: True with the rotation, False
    without it, so that FP8 Q·Kᵀ alone multiplies the unrotated rows the estimate takes)."""
    s = int(s)
    kw = {"qk_balance": bool(s & BALANCE), "qk_rotation": bool(s & ROTATION),
          "qk_scale_search": bool(s & SCALE_SEARCH), "qk_precision": "fp8" if s & QK_FP8 else "fp4",
          "pv_precision": "fp8" if s & PV_FP8 else "fp4"}
    if s & QK_FP8:
        kw["qk_fp8_rotated"] = bool(s & ROTATION)
    return kw


def treatment_applies(s: int, head_dim: int, per_block_mean: bool = True) -> bool:
    """Whether every treatment of set ``s`` exists at ``head_dim``: the balance, the rotation, the
    scale search and FP8 Q·Kᵀ at head dims 64/128 only (the balance also needs per-block Q
    means), FP8 P·V at any head dim. A set the reference would silently run without one of its
    treatments does not apply."""
    s = int(s)
    if s & (ROTATION | SCALE_SEARCH | QK_FP8 | BALANCE) and head_dim not in FP8_HEAD_DIMS:
        return False
    return not (s & BALANCE and not per_block_mean)


def _pad_keys(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Zero-pad ``dim`` to a multiple of 32 (the sampled keys' last block may be partial)."""
    return pad_dim(x, dim, MX_BLOCK)


def treatment_errors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pre, sm_scale: float | None = None,
                     per_block_mean: bool = True, sets=None, is_causal: bool = False) -> torch.Tensor:
    """The estimate, per q head and treatment set, of the relative output error of the quantized
    attention under that set: (B, Hq, TREATMENT_SETS) float32 (+inf for a set that does not apply,
    ``treatment_applies``; ``sets``: an iterable of the set ints to compute, the others +inf).
    ``pre``: ``preprocess(q, k, v, per_block_mean, qk_balance=False, qk_rotation=False)`` (its
    means; any precision). Opt-in: no default path calls it.

    On the rule's sample (``qk_fp4_error``'s: every ``query_stride``-th row of Q's sampled
    128-row blocks against every key of K's sampled blocks; with ``is_causal`` a sampled key after
    a sampled row's position is masked, as the attention masks it: key 0 is always sampled, so
    every row keeps one):

    1. the target O = softmax(c · Q Kᵀ) V in float64 from the inputs (c the softmax scale);
    2. per set: Q and K balanced (``balance_exponents``) and/or rotated as ``preprocess`` does
       them, minus their (balanced, rotated) means, quantized to NVFP4 (with the scale search) or
       to the precise rung (FP8 Q·Kᵀ: MXFP8, at D 64 bf16 rows, ``qk16_rows``; at D 128 the raw
       16-bit rows for the heads ``choose_qk16`` picks, scores q·kᵀ of the inputs) exactly as the
       kernels' operands (bit for bit on these rows); scores
       L = c / ``rotation_score_factor`` · Qd Kdᵀ + c · mean_q · (K - mean_k)ᵀ (the correction in
       float32 from the unquantized means, as the paper's delta_s); per row, P = exp2((L - max)
       · log2 e), quantized as the kernel's P: NVFP4 of P · 2688 along the keys (16-key blocks), or
       MXFP8 (32-key blocks); V̂ = V quantized along the sequence (NVFP4, or MXFP8 with FP8 P·V),
       the same blocks as the kernel's (the sampled blocks start at multiples of 128);
       O_T = P̂ V̂ / Σ P (row sums of the unquantized P, as the kernel's);
    3. error = ||O_T - O|| / ||O|| over the head's sampled rows (Frobenius norms).

    Unlike ``qk_fp4_error`` it counts every error the kernel makes (Q·Kᵀ, P, V) against exact
    attention, including P's on rows the correction (Q's mean) makes peaky, and (with the mask)
    on the short rows of a causal call. One row max per sampled row stands for the kernel's
    running max per tile."""
    b, hq, sq, d = q.shape
    sk = k.shape[2]
    if pre.balance is not None or pre.qk_rotation or pre.k_block_corr is not None:
        raise ValueError("treatment_errors: pass the Preprocessed of preprocess(q, k, v, per_block_mean, "
                         "qk_balance=False, qk_rotation=False) (its raw means)")
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    stride = query_stride(sq, sk)
    cat = lambda views: torch.cat(views, dim=-2)  # noqa: E731
    q_rows = cat(_sampled_rows(q, sq, stride)).float()  # (B, Hq, R, D)
    k_rows = cat(_sampled_rows(k, sk, 1)).float()  # (B, Hkv, N, D)
    v_rows = cat(_sampled_rows(v, sk, 1)).float()
    mq_rows = _mean_rows(pre.mean_q, sq, stride)  # raw means, per sampled row
    # the target, float64 from the inputs, and the correction (same for every set)
    qx, kx, vx = q_rows.double(), expand_kv(k_rows, hq).double(), expand_kv(v_rows, hq).double()
    masked = None
    if is_causal:
        masked = _sampled_positions(sk, 1, q.device)[None, :] > _sampled_positions(sq, stride, q.device)[:, None]
    s_exact = torch.matmul(qx, kx.transpose(-1, -2)) * scale
    if masked is not None:
        s_exact = s_exact.masked_fill(masked, float("-inf"))
    o = torch.matmul(torch.softmax(s_exact, dim=-1), vx)
    corr = torch.matmul(mq_rows, expand_kv(k_rows - pre.mean_k, hq).transpose(-1, -2)) * scale
    n_keys = k_rows.shape[-2]
    vq = {False: expand_kv(dequantize_transposed_tiled(*quantize_transposed_tiled(v_rows), n_keys) if d % V_GROUP == 0
                           else dequantize_transposed(*quantize_transposed(v_rows), n_keys), hq),
          True: expand_kv(dequantize_mxfp8_transposed(*quantize_mxfp8_transposed(v_rows), n_keys), hq)}
    bal = balance_exponents(q, k) if (d in FP8_HEAD_DIMS and per_block_mean) else None
    wanted = set(range(TREATMENT_SETS)) if sets is None else {int(s) for s in sets}
    out = torch.full((b, hq, TREATMENT_SETS), float("inf"), dtype=torch.float32, device=q.device)
    den = o.square().sum(dim=(-1, -2)).clamp_min(1e-300)
    # at D 128 the precise rung of the heads ``choose_qk16`` picks: the raw 16-bit rows (their scores
    # q·kᵀ of the inputs, no correction)
    raw = None
    if d == QK16_RAW_HEAD_DIM and any(int(s) & QK_FP8 for s in wanted):
        raw = (qk16_stat(q, k, pre, sm_scale) > _package.QK16_STAT_LIMIT)[..., None, None]
        lg_raw = torch.matmul(q_rows, expand_kv(k_rows, hq).transpose(-1, -2)) * scale
    for s in sorted(wanted):
        if not treatment_applies(s, d, per_block_mean):
            continue
        cq = ck = 1.0
        if s & BALANCE:
            ck, cq = torch.exp2(bal), expand_kv(torch.exp2(-bal), hq)
        turn = rotate if s & ROTATION else (lambda x: x.float())
        qs = turn(q_rows * cq) - turn(mq_rows * cq)
        ks = turn(k_rows * ck) - turn(pre.mean_k * ck)
        if s & QK_FP8:  # the precise rung: bf16 rows at D 64 (the 16-bit Q·Kᵀ), MXFP8 rows otherwise
            qd, kd = (qk16_rows(x).float() if d == QK16_HEAD_DIM else dequantize_mxfp8_rows(*quantize_mxfp8_rows(x))
                      for x in (qs, ks))
        else:
            qd = dequantize_rows(*quantize_rows(qs, bool(s & SCALE_SEARCH)))
            kd = dequantize_rows(*quantize_rows(ks, bool(s & SCALE_SEARCH)))
        c = scale / rotation_score_factor(d, bool(s & ROTATION))
        lg = torch.matmul(qd, expand_kv(kd, hq).transpose(-1, -2)) * c + corr
        if raw is not None and s & QK_FP8:
            lg = torch.where(raw, lg_raw, lg)
        if masked is not None:
            lg = lg.masked_fill(masked, float("-inf"))
        t = lg * 1.4426950408889634
        p = torch.exp2(t - t.amax(dim=-1, keepdim=True))
        pp = _pad_keys(p, -1)
        if s & PV_FP8:
            ph = mxfp8_p(pp)[..., :n_keys]
        else:
            ph = dequantize_rows(*quantize_rows(pp * (E4M3_MAX * FP4_MAX)))[..., :n_keys] / (E4M3_MAX * FP4_MAX)
        o_t = torch.matmul(ph, vq[bool(s & PV_FP8)]) / p.sum(dim=-1, keepdim=True)
        num = (o_t.double() - o).square().sum(dim=(-1, -2))
        out[..., s] = torch.sqrt(num / den).float()
    return out


def choose_treatments(errors: torch.Tensor, floors=0, limit: float | None = None,
                      keep: float | None = None) -> torch.Tensor:
    """Per q head, the treatment set to run, from ``treatment_errors``' estimates (B, Hq,
    TREATMENT_SETS); (B, Hq) int64. ``floors``: the treatments a call forces on (an int set, or a
    (B, Hq) integer tensor; 0: none): every set chosen contains them, and the rule may add others.

    1. A head that plain FP4 (set 0) and its floor set both estimate at most ``keep`` (None:
       ``TREATMENT_KEEP_LIMIT``) keeps its floors: heads whose FP4 error sits near the target by
       nature (zero-mean data: 0.18-0.21, the estimate's noise around it) stay on today's path,
       with or without options; a head FP4 serves badly gets no such slack.
    2. Otherwise the cheapest set containing the floors (the smallest int: the bits are the
       cost order) whose estimate is at most ``limit`` (None: ``TREATMENT_ERROR_LIMIT``).
    3. Where none meets it, the set containing the floors with the smallest estimate (the
       cheaper of equal ones).

    Sets that do not apply (+inf) and NaN estimates (NaN inputs) never qualify; a head with no
    finite estimate keeps its floors."""
    limit = _package.TREATMENT_ERROR_LIMIT if limit is None else limit
    keep = _package.TREATMENT_KEEP_LIMIT if keep is None else keep
    if errors.shape[-1] != TREATMENT_SETS:
        raise ValueError(f"choose_treatments: errors must be (..., {TREATMENT_SETS}), got {tuple(errors.shape)}")
    sets = torch.arange(TREATMENT_SETS, device=errors.device)
    fl = torch.as_tensor(floors, device=errors.device).to(torch.int64).expand(errors.shape[:-1])
    allowed = (sets & fl.unsqueeze(-1)) == fl.unsqueeze(-1)  # (B, Hq, S)
    err = torch.where(allowed & ~torch.isnan(errors), errors, torch.full_like(errors, float("inf")))
    big = torch.full_like(err, TREATMENT_SETS, dtype=torch.int64)
    cheapest = torch.where(err <= limit, sets.expand_as(err), big).amin(dim=-1)
    best = torch.where(torch.isfinite(err.amin(dim=-1)), err.argmin(dim=-1), fl)  # argmin: the first minimum
    chosen = torch.where(cheapest < TREATMENT_SETS, cheapest, best)
    floor_err = torch.gather(err, -1, fl.unsqueeze(-1)).squeeze(-1)
    plain = torch.where(torch.isnan(errors[..., 0]), torch.full_like(errors[..., 0], float("inf")), errors[..., 0])
    return torch.where((floor_err <= keep) & (plain <= keep), fl, chosen)
