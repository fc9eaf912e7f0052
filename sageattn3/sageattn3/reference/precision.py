"""The Q·Kᵀ precision per head: FP4, or MXFP8 where the rule ("auto") estimates that FP4 Q·Kᵀ
costs the output too much (``qk_fp4_error``, ``choose_qk_precision``).

The rule reads a ``preprocessing.Preprocessed`` (its quantized Q and K, means and balance) and
is called by ``preprocess``: it sits below the preprocessing and names no type of it.
"""

from __future__ import annotations

import math

import torch

from sageattn3 import reference as _package  # the knobs (AUTO_QUERY_STRIDE, AUTO_ERROR_LIMIT), read per call

from .formats import BLOCK, e4m3_decode, unpack_codes
from .transforms import Q_MEAN_BLOCK, expand_kv, sample_blocks

QK_PRECISIONS = ("fp4", "fp8", "auto")
QK_PRECISION_DEFAULT = "auto"
FP8_HEAD_DIMS = (64, 128)
# P·V: "fp4" (the default: P two-level NVFP4, V NVFP4 along the sequence) or "fp8" (P and V in
# MXFP8: ``reference.sageattn3``'s docstring). Reference only so far: opt-in.
PV_PRECISIONS = ("fp4", "fp8")
PV_PRECISION_DEFAULT = "fp4"


def qk_precision_arg(value) -> str:
    """Checks a ``qk_precision`` argument: one of "fp4", "fp8", "auto"."""
    if not isinstance(value, str) or value not in QK_PRECISIONS:
        raise ValueError(f"qk_precision must be one of {', '.join(map(repr, QK_PRECISIONS))}, got {value!r}")
    return value


def pv_precision_arg(value) -> str:
    """Checks a ``pv_precision`` argument: one of "fp4", "fp8"."""
    if not isinstance(value, str) or value not in PV_PRECISIONS:
        raise ValueError(f"pv_precision must be one of {', '.join(map(repr, PV_PRECISIONS))}, got {value!r}")
    return value


def fp8_applies(rotated: bool, head_dim: int) -> bool:
    """The FP8 Q·Kᵀ path exists at head dims 64/128 without the Q/K rotation."""
    return head_dim in FP8_HEAD_DIMS and not rotated


def fp8_unavailable(rotated: bool, head_dim: int) -> str:
    if head_dim not in FP8_HEAD_DIMS:
        return f"qk_precision='fp8' needs head_dim 64 or 128, got {head_dim}; use qk_precision='fp4' or 'auto'"
    return ("qk_precision='fp8' does not combine with qk_rotation=True; drop one of them (with the rotation, "
            "qk_precision='auto' keeps FP4 on every head)")


def _sampled_rows(x: torch.Tensor, seq: int, stride: int) -> list[torch.Tensor]:
    """Every ``stride``-th real row of each sampled 128-row block of x (..., S_or_padded, D), as
    views, block by block (no host data reaches the device: slicing only)."""
    return [x[..., t * Q_MEAN_BLOCK : min(seq, (t + 1) * Q_MEAN_BLOCK) : stride, :] for t in sample_blocks(seq)]


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

    1. Query rows: every ``AUTO_QUERY_STRIDE``-th row of Q's sampled 128-row blocks
       (``sample_blocks``), smoothed as the preprocessing smoothed them (balanced, minus their
       block's mean: Q_s), and the same rows of the FP4 Q the kernel reads (Qd, dequantized).
    2. Keys: every row of K's sampled blocks, K_s (balanced, minus mean_k) and Kd likewise; V's
       same rows.
    3. L = c · Q_s K_sᵀ and L4 = c · Qd Kdᵀ with c the softmax scale (default 1/sqrt(D)); O =
       softmax(L) V and O4 = softmax(L4) V (no mask: a statistic of the head).
    4. error = ||O4 - O|| / ||O|| over the head's sampled rows (Frobenius norms).

    Only Q·Kᵀ's FP4 error enters (the correction delta_s is the same in both and cancels); the
    error of P·V, which FP8 Q·Kᵀ would not change, does not. Heads whose scores span a wide
    range (near-one-hot rows), whose keys keep a large component after smoothing (biases that
    rotary embeddings turn with the position) or whose channels have outliers come out large."""
    b, hq, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    cq = 1.0 if pre.balance is None else expand_kv(torch.exp2(-pre.balance), hq)
    ck = 1.0 if pre.balance is None else torch.exp2(pre.balance)
    if pre.k_block_corr is not None:
        raise ValueError("qk_fp4_error: K's per-block means (k_block_mean) are not part of the rule")
    cat = lambda views: torch.cat(views, dim=-2)  # noqa: E731  (one gather per operand)
    nm = pre.mean_q.shape[-2]
    q_rows = _sampled_rows(q, sq, _package.AUTO_QUERY_STRIDE)
    means = cat([pre.mean_q[..., (t if nm > 1 else 0):(t if nm > 1 else 0) + 1, :].expand(b, hq, blk.shape[-2], d)
                 for t, blk in zip(sample_blocks(sq), q_rows)])
    qs = cat(q_rows).float() * cq - means
    qd = _dequantize_fp4_rows(cat(_sampled_rows(pre.q_packed, sq, _package.AUTO_QUERY_STRIDE)),
                              cat(_sampled_rows(pre.q_scales, sq, _package.AUTO_QUERY_STRIDE)))
    ks = cat(_sampled_rows(k, sk, 1)).float() * ck - pre.mean_k
    kd = _dequantize_fp4_rows(cat(_sampled_rows(pre.k_packed, sk, 1)), cat(_sampled_rows(pre.k_scales, sk, 1)))
    vs = cat(_sampled_rows(v, sk, 1)).float()
    ks, kd, vs = expand_kv(ks, hq), expand_kv(kd, hq), expand_kv(vs, hq)
    o = torch.matmul(torch.softmax(torch.matmul(qs, ks.transpose(-1, -2)) * scale, dim=-1), vs)
    o4 = torch.matmul(torch.softmax(torch.matmul(qd, kd.transpose(-1, -2)) * scale, dim=-1), vs)
    num = (o4 - o).square().sum(dim=(-1, -2))
    den = o.square().sum(dim=(-1, -2)).clamp_min(1e-30)
    return torch.sqrt(num / den)


def choose_qk_precision(precision: str, error: torch.Tensor) -> torch.Tensor:
    """(B, Hq) bool, True where a q head's Q·Kᵀ runs in FP8: "fp8" every head, "fp4" none,
    "auto" the heads whose ``qk_fp4_error`` exceeds ``AUTO_ERROR_LIMIT`` (a NaN estimate, from
    NaN inputs, keeps FP4)."""
    precision = qk_precision_arg(precision)
    if precision == "auto":
        return error > _package.AUTO_ERROR_LIMIT
    return torch.full_like(error, precision == "fp8", dtype=torch.bool)
