"""The Q/K transforms: the randomized Hadamard rotation, the channel balance and the sampled
128-token blocks that the means and the balance statistics come from.

Neither changes the attention: the rotation multiplies every score by D/64
(``rotation_score_factor``, undone through the softmax scale), and the balance multiplies a
channel of Q and the same channel of K by reciprocal powers of two (exact in float32). Both move
FP4 error away from outlier channels.
"""

from __future__ import annotations

import torch

from sageattn3 import reference as _package  # the knobs (QK_SCALE_SEARCH, MEAN_SAMPLE_BLOCKS), read per call

Q_MEAN_BLOCK = 128  # tokens per Q mean block (per_block_mean=True) and per sampled block


# ---------------------------------------------------------------------------------------------
# Q/K rotation
# ---------------------------------------------------------------------------------------------

ROTATION_HEAD_DIMS = (64, 128)  # head dims the rotation applies to (the FP4 kernel's)
# Sign vector of the rotation: bit d set -> channel d is negated (the first D bits for head dim
# D). Drawn once: random.Random(3).getrandbits(128). csrc/preprocess/rotation.cuh holds the same
# bits (a CPU test compares them).
ROTATION_SIGN_BITS = 0x216363698B529B4A97B750923CEB3FFD
ROTATION_SCALE = 0.125  # 2^-3: exact in float32
# What sageattn3_blackwell / preprocess do unless told otherwise: off. Measured on an H100 (the
# MMA-model test flavour, 24 heads x 32k tokens, D 128, back to back) the rotation makes Q's and
# K's launch 0.252 -> 0.407 ms, about +45% of the whole preprocessing (3 shuffle stages of 16
# values per row block, on top of the software E2M1), far over the 5% it could cost to be on by
# default; alone it helps with Q outlier channels at D 128 and with outliers Q and K share, hurts
# with K outlier channels, and is within noise elsewhere (after the channel balance it helps
# wherever outliers are: README, "Accuracy"). qk_rotation=True turns it on.
QK_ROTATION_DEFAULT = False


def rotation_applies(head_dim: int) -> bool:
    return head_dim in ROTATION_HEAD_DIMS


def rotation_signs(head_dim: int, device=None) -> torch.Tensor:
    """(D,) float32: -ROTATION_SCALE where bit d of ROTATION_SIGN_BITS is set, else +ROTATION_SCALE."""
    bits = torch.tensor([(ROTATION_SIGN_BITS >> d) & 1 for d in range(head_dim)], dtype=torch.float32, device=device)
    return ROTATION_SCALE * (1.0 - 2.0 * bits)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """The randomized Hadamard rotation of the last dim (D 64 or 128), float32, bit-exact with
    the preprocessing kernels: y = x * s (s_d = +-1/8, ``rotation_signs``; exact), then the
    Walsh-Hadamard butterflies in float32, stages h = 1, 2, 4, ..., D/2 in that order: for each
    i with (i & h) == 0, (y_i, y_{i+h}) <- (y_i + y_{i+h}, y_i - y_{i+h}).

    As a matrix, x -> x S H / 8 with S = diag(+-1) and H the Sylvester Hadamard matrix
    (H Hᵀ = D I), so rotate(q) · rotate(k)ᵀ = (D / 64) · q · kᵀ (``rotation_score_factor``):
    attention is unchanged once the softmax scale is divided by that factor. The rotation spreads
    an outlier channel over all D channels before the 16-channel NVFP4 blocks are formed."""
    d = x.shape[-1]
    if not rotation_applies(d):
        raise ValueError(f"the rotation is defined for head_dim {'/'.join(map(str, ROTATION_HEAD_DIMS))}, got {d}")
    return _butterflies(x.float() * rotation_signs(d, x.device))


def _butterflies(y: torch.Tensor) -> torch.Tensor:
    """The Walsh-Hadamard butterflies of ``rotate`` on the last dim of float32 y."""
    shape, d = y.shape, y.shape[-1]
    h = 1
    while h < d:
        y = y.reshape(*shape[:-1], d // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2)
        h *= 2
    return y.reshape(shape)


def unrotate(y: torch.Tensor) -> torch.Tensor:
    """The inverse of ``rotate`` up to float32 rounding: the butterflies, then each channel times
    its sign and 8/D (exact: H H = D I and the signs' 1/8 undone). Elementwise float32 operations
    only, in a fixed order: the same bits on every device."""
    d = y.shape[-1]
    if not rotation_applies(d):
        raise ValueError(f"the rotation is defined for head_dim {'/'.join(map(str, ROTATION_HEAD_DIMS))}, got {d}")
    return _butterflies(y.float()) * (rotation_signs(d, y.device) * (64.0 / d))


def rotation_score_factor(head_dim: int, rotated: bool) -> float:
    """rotate(q)·rotate(k)ᵀ / (q·kᵀ): D/64 (1 for D 64, 2 for D 128), or 1 without rotation."""
    return head_dim / 64.0 if rotated else 1.0



# ---------------------------------------------------------------------------------------------
# Q/K channel balance
# ---------------------------------------------------------------------------------------------

# A Q channel much larger than the others (an outlier channel) multiplies K's FP4 error in that
# channel into every score, and a large K channel Q's. The balance evens the ratio of Q's to K's
# channel RMS out: per KV head, Q's channel d is multiplied by 2^-e_d and K's by 2^e_d after
# smoothing, which leaves every score Q·Kᵀ unchanged (powers of two: exact in float32).
# e_d from Q's and K's channel RMS over their sampled blocks (``balance_exponents``).
BALANCE_HEAD_DIMS = (64, 128)
BALANCE_MAX_EXP = 2  # |e_d| <= 2: channels scaled by 1/4 .. 4
# Off unless asked for (qk_balance=True): measured on an H100 (24 heads x 32k tokens, D 128, bf16,
# back to back) the whole preprocessing takes 0.400-0.402 ms with it against 0.382-0.383 ms without (+5%: the
# sampled blocks' sums of squares and one multiply per element; +7% in earlier runs), about the 5%
# a default may cost.
QK_BALANCE_DEFAULT = False


def scale_search_on(qk_scale_search: bool | None, qk_rotation: bool = False) -> bool:
    """The scale search a call asked for, as a bool: ``qk_scale_search``, or where it is None
    ``QK_SCALE_SEARCH``, or on with ``qk_rotation``. The rotation brings the scale search with it
    unless the call says False: rotated rows round differently in FP4, below the unrotated rows on
    about half of the heads that need no help (up to 0.0003 cos-sim on a cell of the accuracy
    table), and the scale search's gain on those heads (0.0005-0.002) keeps the rotation at or
    above the defaults (docs/accuracy-auto.md, "The options against the defaults"). The balance
    does not bring it: where no channel stands out it changes nothing, bit for bit."""
    rotation = flag(qk_rotation, "qk_rotation")
    if qk_scale_search is None:
        return flag(_package.QK_SCALE_SEARCH, "qk_scale_search") or rotation
    return flag(qk_scale_search, "qk_scale_search")


def scale_search_applies(qk_scale_search: bool | None, head_dim: int, qk_rotation: bool = False) -> bool:
    """Whether Q and K are quantized with the scale search: ``scale_search_on`` at head dims
    64/128, never at others."""
    return scale_search_on(qk_scale_search, qk_rotation) and head_dim in BALANCE_HEAD_DIMS


def flag(value, name: str) -> bool:
    """``value`` as a bool: True, False, or 0/1; anything else (a string, None, a tensor) is a
    TypeError naming ``name``, so that ``"False"`` never silently means True."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if type(value).__name__ == "bool_":  # numpy.bool_
        return bool(value)
    raise TypeError(f"{name} must be True or False, got {value!r}")


def balance_applies(head_dim: int) -> bool:
    """The balance applies at head dims 64/128, with or without the rotation (balanced first,
    then rotated: the rotation spreads what is left of an outlier channel), and with per-block Q
    means (``preprocess`` leaves it off with per_block_mean=False, where the kernels would need
    a second pass over Q and K)."""
    return head_dim in BALANCE_HEAD_DIMS


def sample_blocks(seq: int) -> list[int]:
    """The 128-token blocks the sampled means (``sample_mean``) and the balance statistics come
    from: (i * n) // m for i < m, with n = ceil(seq / 128) blocks and m = min(MEAN_SAMPLE_BLOCKS,
    n): every block up to 1024 tokens, then 8 evenly spaced ones."""
    n = -(-seq // Q_MEAN_BLOCK)
    m = min(_package.MEAN_SAMPLE_BLOCKS, n)
    return [(i * n) // m for i in range(m)]


def sample_mean(x: torch.Tensor) -> torch.Tensor:
    """(..., 1, D) float32: the mean of x (..., S, D) over the real rows of its sampled blocks
    (``sample_blocks``): float32 sum / their row count (the kernels sum in their own order)."""
    s = x.shape[-2]
    parts = [x[..., t * Q_MEAN_BLOCK : min(s, (t + 1) * Q_MEAN_BLOCK), :].float() for t in sample_blocks(s)]
    rows = sum(p.shape[-2] for p in parts)
    return torch.cat(parts, dim=-2).sum(dim=-2, keepdim=True) / float(rows)


def _sampled_square_sums(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(B, H, D) float32: for each head, the sum over its sampled blocks (``sample_blocks``, in
    order) of each block's sum over its real rows of (x - the block's own mean)² (the block mean
    as float32 sum / count); and the rows counted."""
    s = x.shape[-2]
    xf = x.float()
    ss = torch.zeros(*x.shape[:-2], x.shape[-1], dtype=torch.float32, device=x.device)
    count = 0
    for t in sample_blocks(s):
        blk = xf[..., t * Q_MEAN_BLOCK : min(s, (t + 1) * Q_MEAN_BLOCK), :]
        mu = blk.sum(dim=-2, keepdim=True) / float(blk.shape[-2])
        ss = ss + ((blk - mu) ** 2).sum(dim=-2)
        count += blk.shape[-2]
    return ss, count


def _pairwise_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (a power of two) as a pairwise tree: d = 2i with 2i + 1 first."""
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x


def balance_exponents(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """(B, Hkv, 1, D) float32 e_d in {-2, ..., 2} (as float), per KV head, from q (B, Hq, Sq, D)
    and k (B, Hkv, Sk, D):

    1. per channel, Q's mean square a_d² over the sampled blocks (``sample_blocks``) of every q
       head of the group, each block about its own mean (``_sampled_square_sums``: the summed
       squares / (rows x q heads)), and K's b_d² likewise over K's sampled blocks;
    2. a_d = sqrt(a_d²), b_d = sqrt(b_d²), r_d = a_d / b_d (float32); a channel is valid when
       a_d > 0, b_d > 0 and r_d is finite;
    3. m = (pairwise sum of r_d over the valid channels, 0 elsewhere) / (pairwise sum of the
       valid flags), the sums as trees (d = 2i with 2i + 1 first);
    4. e_d = [r_d >= 2m] + [r_d >= 8m] - [r_d < m/2] - [r_d < m/8] on valid channels, i.e.
       round(log2(r_d / m) / 2) clamped to +-2, and 0 on the others; 0 everywhere when m is not
       a positive finite number.

    Q's channel d is then scaled by 2^-e_d and K's by 2^e_d: the ratio of Q's to K's channel RMS
    is pulled towards the typical ratio (the product of the two RMS is unchanged), which is what
    minimises the FP4 error of Q·Kᵀ for independent errors. A channel large in Q only moves into
    K, one large in K only moves into Q, and one large in both (where scaling would only move
    error around) stays. The kernels compute the same in their own summation order (float32):
    the exponents agree except where r_d lies within rounding of a threshold; tests feed the
    kernels' exponents to ``preprocess`` (``balance=``) to compare the quantized tensors bit for
    bit."""
    if not isinstance(k, torch.Tensor) or q.dim() != 4 or k.dim() != 4:
        raise TypeError("balance_exponents(q, k): q (B, Hq, Sq, D) and k (B, Hkv, Sk, D) tensors")
    b, hq, _, d = q.shape
    hk = k.shape[1]
    if k.shape[0] != b or k.shape[3] != d or hk == 0 or hq % hk:
        raise ValueError(f"balance_exponents: q {tuple(q.shape)} and k {tuple(k.shape)} need the same batch and "
                         f"head dim, and Hq a multiple of Hkv")
    rep = hq // hk
    ssq, nq = _sampled_square_sums(q)
    ssk, nk = _sampled_square_sums(k)
    msq = ssq.reshape(b, hk, rep, d).sum(dim=2) / float(nq * rep)
    msk = ssk / float(nk)
    a, bk = torch.sqrt(msq), torch.sqrt(msk)
    r = a / bk
    valid = (a > 0) & (bk > 0) & torch.isfinite(r)
    rs = _pairwise_sum(torch.where(valid, r, torch.zeros_like(r)))
    n = _pairwise_sum(valid.float())
    m = rs / n
    e = ((r >= 2 * m).float() + (r >= 8 * m).float() - (r < m / 2).float() - (r < m / 8).float())
    ok = valid & torch.isfinite(m) & (m > 0)
    return torch.where(ok, e, torch.zeros_like(e)).unsqueeze(-2)



def expand_kv(x: torch.Tensor, q_heads: int) -> torch.Tensor:
    """(B, Hkv, ...) -> (B, Hq, ...): q head h reads kv head h // (Hq / Hkv)."""
    rep = q_heads // x.shape[1]
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)

