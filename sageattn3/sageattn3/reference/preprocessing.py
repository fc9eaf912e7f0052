"""The preprocessing: Q's and K's means, the smoothing, the NVFP4 (and MXFP8) operands the
attention kernel consumes (``Preprocessed``, ``preprocess``) and the correction delta_s."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .formats import (
    MX_BLOCK,
    dequantize_rows,
    pad_dim,
    QK16_HEAD_DIM,
    QK16_RAW_HEAD_DIM,
    qk16_rows,
    quantize_mxfp8_rows,
    quantize_mxfp8_transposed,
    quantize_residual,
    quantize_rows,
    quantize_transposed,
    V_GROUP,
    quantize_transposed_tiled,
)
from .precision import (
    PV_PRECISION_DEFAULT,
    choose_pv_precision,
    choose_qk16,
    choose_qk_precision,
    fp8_applies,
    fp8_unavailable,
    pv_p_error,
    pv_precision_arg,
    qk16_stat,
    qk_fp4_error,
    qk_precision_arg,
    rule_limit,
)
from .transforms import (
    QK_BALANCE_DEFAULT,
    QK_ROTATION_DEFAULT,
    Q_MEAN_BLOCK,
    balance_applies,
    balance_exponents,
    expand_kv,
    flag,
    rotate,
    rotation_applies,
    sample_mean,
    scale_search_applies,
)


def k_mean(k: torch.Tensor) -> torch.Tensor:
    """The mean K is smoothed by, per (batch, head): (B, H, 1, D) float32, ``sample_mean``."""
    return sample_mean(k)


def q_mean(q: torch.Tensor, per_block_mean: bool = True) -> torch.Tensor:
    """Q means, (B, H, nblk, D) float32: per 128-token block (the last block averages only its
    real tokens), or one mean for the whole sequence (nblk = 1, ``sample_mean``)."""
    qf = q.float()
    if not per_block_mean:
        return sample_mean(qf)
    s = q.shape[-2]
    nblk = -(-s // Q_MEAN_BLOCK)
    qp = pad_dim(qf, -2, Q_MEAN_BLOCK).reshape(*q.shape[:-2], nblk, Q_MEAN_BLOCK, q.shape[-1])
    counts = torch.clamp(s - torch.arange(nblk, device=q.device) * Q_MEAN_BLOCK, max=Q_MEAN_BLOCK)
    return qp.sum(dim=-2) / counts.to(torch.float32).unsqueeze(-1)



def q_block_index(seq_q: int, n_means: int, device=None) -> torch.Tensor:
    """For each query row, which Q mean (and delta_s row) it uses."""
    idx = torch.arange(seq_q, device=device) // Q_MEAN_BLOCK
    return idx if n_means > 1 else torch.zeros_like(idx)



@dataclass
class Preprocessed:
    """What the attention kernel consumes (all sequence dims padded with zeros to ``pad``).

    With ``qk_rotation`` (head dims 64 and 128) Q and K are rotated first (``rotate``) and
    everything below lives in the rotated space; means are rotated means (the rotation is
    linear: mean(rotate(x)) = rotate(mean(x))).

    - q_packed (B, Hq, Sq_p, D/2) uint8, q_scales (B, Hq, Sq_p, D/16) e4m3: Q - mean_q, rows.
    - k_packed (B, Hkv, Sk_p, D/2), k_scales (B, Hkv, Sk_p, D/16): K - mean_k, rows.
    - v_packed (B, Hkv, D, Sk_p/2), v_scales (B, Hkv, D, Sk_p/16): V along the sequence.
    - mean_q (B, Hq, nblk, D) float32: the Q means removed from Q (nblk = ceil(Sq/128) with
      per_block_mean, else 1 (``sample_mean``); query row i uses mean i // 128, or 0); mean_k
      (B, Hkv, 1, D) (``sample_mean``).
    - mean_q_global (B, Hq, 1, D) float32: Q's mean for the whole sequence, ``sample_mean`` (=
      mean_q without per_block_mean).
    - delta_key (B, Hq, Sk_p) float32: mean_q_global · K_sᵀ per key with K_s the UNQUANTIZED
      smoothed K, exactly the float32 values the quantizer takes (balanced and/or rotated, in that
      order; float64 products; 0 in padded columns).
    - balance (B, Hkv, 1, D) float32 or None: the channel balance exponents e
      (``balance_exponents``) when the balance applies. Q and K then live in the balanced space:
      q_packed holds Q·2^-e - mean_q and k_packed K·2^e - mean_k, and mean_q, mean_q_global and
      mean_k are the means times 2^-e (Q) or 2^e (K), all exact float32 products; scores and
      delta_key are unchanged by it. With the rotation too, Q and K are balanced first and then
      rotated (the means likewise).
    - qk_scale_search: whether q_packed/k_packed were quantized with the scale search.
    - k_residual (B, Hkv, Sk_p, D) float16, with per_block_mean (else None): K's quantization
      residual (``quantize_residual`` of the smoothed K rows k_packed holds; 0 in padded rows).
    - delta_s (a property; the kernel never materialises it) (B, Hq, nblk, Sk_p): the correction
      added to Qd·Kdᵀ, delta_s[i, j] = delta_key[j] + r_i · K̂_j with r_i = mean_q[i] -
      mean_q_global (float32 subtraction) and K̂ = ``dequantize_rows``(k_packed, k_scales,
      k_residual), the dequantized smoothed K plus its quantization residual (Kd alone where
      k_residual is None: then r = 0). SageAttention2/3 add mean_q · K_sᵀ (K_s = K - mean_k,
      unquantized) = delta_key + r_i · K_s: the two differ by r_i · (K̂ - K_s), the float16 rounding
      of K's quantization error (at most 2^-11 of it) times the block residual. Without
      per_block_mean r = 0: the paper's correction exactly. The attention kernel adds delta_key
      per key and computes r_i · K̂_j per 128-key tile from the K tile it holds and the residual
      values (skipped where r_i is zero). Why this form: materialising mean_q · K_sᵀ costs
      (B, Hq, Sq/128, Sk) fp32 (~800 MB at 24 heads x 32k tokens); delta_key is (B, Hq, Sk) (3 MB
      there) and costs K's quantization one dot product per key and q head over the row it
      already holds, the residual two bytes per element of K (200 MB there) written from the same
      registers. Through Kd alone (no residual) r_i · (Kd - K_s) is the whole of K's quantization
      error times r_i, which is large where Q's block means drift along the sequence: there it
      lost up to 0.06 cos-sim against the paper; with the residual the two agree to 0.0001 on
      every case of tests/bench/accuracy.py (README, "Accuracy").
    - qk_fp8 (B, Hq) bool or None: the q heads whose Q·Kᵀ leaves FP4 for the precise rung
      (``qk_precision``; None: every head in FP4, today's path). At D 128 that is MXFP8: q8/q8_scales
      (B, Hq, Sq_p, D) float8_e4m3fn + (B, Hq, Sq_p, D/32) uint8 and k8/k8_scales (B, Hkv, Sk_p, D)
      + (B, Hkv, Sk_p, D/32): the same smoothed Q and K rows as q_packed/k_packed in MXFP8
      (``quantize_mxfp8_rows``). At D 64 it is 16-bit: q8/k8 the same rows in bfloat16
      (``qk16_rows``) and q8_scales/k8_scales None. The reference fills every head, the kernels
      only the heads that use them (a kv head when any of its q heads does).
    - qk_error (B, Hq) float32 or None: the rule's estimate of the relative output error FP4
      Q·Kᵀ causes (``qk_fp4_error``; with qk_precision "auto").
    - qk16 (B, Hq) bool or None (D 128, where the rule runs): the heads of qk_fp8 whose Q·Kᵀ
      multiplies the raw 16-bit rows instead of MXFP8 (``choose_qk16`` of ``qk16_stat``, kept in
      qk16_stat): the scores are q·kᵀ of the fp16/bf16 inputs as they are (q16, k16: the inputs;
      exact products, float32 sums), in unrotated units, with no delta_s (K's and Q's means are
      in the raw rows already, and K's adds one constant a row); the kernels read the inputs.
    - k_block_corr (B, Hq, Sq, Sk_p/128) float32 or None (``k_block_mean``, reference only): K is
      smoothed by its mean per 128-key block mu_b instead of one mean, and the scores of key block
      b get Q_i · (mu_b - mean_k) back (float64 products from the unquantized, balanced Q).
    - v8 (B, Hkv, D, Sk_p) float8_e4m3fn and v8_scales (B, Hkv, D, Sk_p/32) uint8, or None: V in
      MXFP8 along the sequence (``quantize_mxfp8_transposed``), with pv_precision "fp8" (the FP8
      P·V path), or "auto" where the rule ran; Sk_p is then a multiple of 32.
    - pv_fp8 (B, Hq) bool or None: with pv_precision "auto", the q heads whose P·V runs in MXFP8
      (``choose_pv_precision``; None: the rule did not run, every head as pv_precision says), and
      pv_error (B, Hq) float32 the estimate it came from (``pv_p_error``).
    - v_exp (B, Hkv, ceil(Sk_p/128), D/32) int8, or None (``v_tile_exponent`` False, or D not a
      multiple of 32): v_packed and v_scales are then the NVFP4 of V · 2^e per tile of 128 keys and
      32 channels (``quantize_transposed_tiled``), not of V: dequantize them with
      ``dequantize_transposed_tiled``, and pass v_exp with them to the attention, which multiplies
      by 2^-e again (the kernels: in the online softmax's rescale and the epilogue).
    """

    q_packed: torch.Tensor
    q_scales: torch.Tensor
    k_packed: torch.Tensor
    k_scales: torch.Tensor
    v_packed: torch.Tensor
    v_scales: torch.Tensor
    mean_q: torch.Tensor
    mean_k: torch.Tensor
    seq_q: int
    seq_k: int
    mean_q_global: torch.Tensor
    delta_key: torch.Tensor
    qk_rotation: bool
    balance: torch.Tensor | None = None
    qk_scale_search: bool = False
    k_residual: torch.Tensor | None = None
    qk_fp8: torch.Tensor | None = None
    q8: torch.Tensor | None = None
    q8_scales: torch.Tensor | None = None
    k8: torch.Tensor | None = None
    k8_scales: torch.Tensor | None = None
    qk_error: torch.Tensor | None = None
    qk16: torch.Tensor | None = None
    qk16_stat: torch.Tensor | None = None
    q16: torch.Tensor | None = None
    k16: torch.Tensor | None = None
    k_block_corr: torch.Tensor | None = None
    v8: torch.Tensor | None = None
    v8_scales: torch.Tensor | None = None
    pv_fp8: torch.Tensor | None = None
    pv_error: torch.Tensor | None = None
    v_exp: torch.Tensor | None = None

    @property
    def q_mean_residual(self) -> torch.Tensor:
        """(B, Hq, nblk, D) float32: mean_q - mean_q_global, what the kernel multiplies with Kd."""
        return self.mean_q - self.mean_q_global

    @property
    def delta_s(self) -> torch.Tensor:
        kd = expand_kv(dequantize_rows(self.k_packed, self.k_scales, self.k_residual), self.mean_q.shape[1])
        part = torch.matmul(self.q_mean_residual.double(), kd.double().transpose(-1, -2))
        return (self.delta_key.double().unsqueeze(-2) + part).float()


def smooth_q(q: torch.Tensor, mean_q: torch.Tensor) -> torch.Tensor:
    """Q - its mean(s), float32 (one float32 subtraction per element)."""
    idx = q_block_index(q.shape[-2], mean_q.shape[-2], q.device)
    return q.float() - mean_q[..., idx, :]


def delta_s(mean_q: torch.Tensor, k_smoothed: torch.Tensor) -> torch.Tensor:
    """mean_q · K_smoothedᵀ (float64 products, float32 result; GQA: K expanded to the q heads):
    (B, Hq, nblk, Sk). With the unquantized smoothed K this is SageAttention2/3's correction;
    ``Preprocessed.delta_s`` is what the kernel adds (the same up to E4M3 rounding of K's
    quantization error)."""
    ks = expand_kv(k_smoothed.float(), mean_q.shape[1])
    return torch.matmul(mean_q.double(), ks.double().transpose(-1, -2)).float()


# K smoothed per 128-key block (``k_block_mean``, reference only): each block's own mean, and the
# scores of the block get Q_i · (mu_b - mean_k) back.


def k_block_means(k: torch.Tensor) -> torch.Tensor:
    """(B, H, ceil(Sk/128), D) float32: K's mean per 128-key block (the last over its real keys)."""
    return q_mean(k, True)


def k_block_correction(qb: torch.Tensor, dmu: torch.Tensor, pad: int) -> torch.Tensor:
    """Q_i · (mu_b - mean_k) for every query row and key block: (B, Hq, Sq, Sk_p/128) float32
    (float64 products), 0 for padded key blocks. qb: the balanced (unrotated) Q; dmu (B, Hkv,
    nkb, D)."""
    corr = torch.matmul(qb.double(), expand_kv(dmu, qb.shape[1]).double().transpose(-1, -2)).float()
    return pad_dim(corr, -1, pad // Q_MEAN_BLOCK) if pad >= Q_MEAN_BLOCK else corr


def _quantize_v(v: torch.Tensor, tiled: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """V's NVFP4 along the sequence: with its tile exponents (``quantize_transposed_tiled``) or
    plain (exponents None)."""
    return quantize_transposed_tiled(v) if tiled else (*quantize_transposed(v), None)


def preprocess(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    per_block_mean: bool = True,
    pad: int = 128,
    mean_q: torch.Tensor | None = None,
    mean_k: torch.Tensor | None = None,
    mean_q_global: torch.Tensor | None = None,
    qk_rotation: bool = QK_ROTATION_DEFAULT,
    qk_balance: bool = QK_BALANCE_DEFAULT,
    balance: torch.Tensor | None = None,
    qk_scale_search: bool | None = None,
    qk_precision: str = "fp4",
    sm_scale: float | None = None,
    k_block_mean: bool = False,
    pv_precision: str = PV_PRECISION_DEFAULT,
    qk_fp8_rotated: bool = True,
    pv_limit: float | None = None,
    is_causal: bool = False,
    v_tile_exponent: bool = True,
) -> Preprocessed:
    """The reference of the preprocessing kernels. ``qk_rotation``: rotate Q and K (head dims 64
    and 128 only). The means are computed on the raw inputs, then balanced and rotated (as the
    kernels do). ``mean_q`` / ``mean_k`` / ``mean_q_global`` let a test feed a kernel's means
    (float32 sums depend on the order) to compare the quantized tensors bit for bit; without
    per_block_mean, mean_q_global defaults to mean_q. Given means are balanced and rotated already
    (as the kernels write them). ``qk_balance``: the channel balance where it applies
    (``balance_applies``), with the exponents ``balance`` (B, Hkv, 1, D) when given (a kernel's),
    else ``balance_exponents``; Q and K are balanced first and then rotated when both are asked.
    ``qk_scale_search``: Q and K quantized with ``quantize_rows(..., scale_search=True)`` at head
    dims 64/128 (None: ``QK_SCALE_SEARCH``, or on with ``qk_rotation``; ``scale_search_applies``). ``qk_precision``
    ("fp4", "fp8", "auto"; ``choose_qk_precision``) and ``sm_scale`` (the rule's softmax scale, default
    1/sqrt(D)) fill qk_fp8, q8, k8, qk_error; ``k_block_mean`` (reference only, no rotation) smooths
    K per 128-key block (``Preprocessed.k_block_corr``). ``pv_precision``
    "fp8" also fills v8/v8_scales (``pad`` a multiple of 32); "auto" (the default) where the rule
    runs (qk_precision "auto"/"fp8", D 64/128, ``pad`` a multiple of 32) fills pv_error, pv_fp8
    (``pv_limit``, None: ``PV_ERROR_LIMIT``) and v8; ``is_causal``: P's estimate masks the keys a
    causal call hides (``pv_p_error``). With the rotation, q8/k8 are the MXFP8 of the rotated rows
    (as the kernels make them), on which "auto"'s rule estimates. Without it q8/k8 are still the
    MXFP8 of rotated rows (``fp8_rows``) where ``qk_fp8_rotated`` (the default; False: of the
    unrotated smoothed rows, the earlier path, reference only). ``v_tile_exponent`` (the default,
    as the kernels do): V's NVFP4 with a power-of-two factor per tile of 128 keys and 32 channels,
    v_exp (``quantize_transposed_tiled``); False: plain NVFP4 of V (v_exp None, the earlier path,
    which loses blocks of V below about 0.006 and clips above 2688; also where D is not a multiple of 32)."""
    sq, sk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    precision, pv = qk_precision_arg(qk_precision), pv_precision_arg(pv_precision)
    qk_fp8_rotated, is_causal = flag(qk_fp8_rotated, "qk_fp8_rotated"), flag(is_causal, "is_causal")
    if pv == "fp8" and pad % MX_BLOCK:
        raise ValueError(f"pv_precision='fp8' needs the key padding (block_n) to be a multiple of {MX_BLOCK}, got {pad}")
    k_block_mean = flag(k_block_mean, "k_block_mean")
    if k_block_mean and precision != "fp4":
        raise ValueError("k_block_mean is measured with FP4 Q·Kᵀ only: pass qk_precision='fp4' with it")
    per_block_mean, qk_rotation, qk_balance = (flag(per_block_mean, "per_block_mean"), flag(qk_rotation, "qk_rotation"),
                                               flag(qk_balance, "qk_balance"))
    search = scale_search_applies(qk_scale_search, d, qk_rotation)
    rot = qk_rotation and rotation_applies(d)
    turn = rotate if rot else (lambda x: x.float())
    bal, cq, ck = None, 1.0, 1.0
    if qk_balance and per_block_mean and balance_applies(d):
        bal = balance_exponents(q, k) if balance is None else balance.float()
        ck = torch.exp2(bal)
        cq = expand_kv(torch.exp2(-bal), q.shape[1])
    # balanced (exact float32 products) and then rotated
    mq = turn(q_mean(q, per_block_mean) * cq) if mean_q is None else mean_q.float()
    mk = turn(k_mean(k) * ck) if mean_k is None else mean_k.float()
    mg = (mean_q_global.float() if mean_q_global is not None else
          turn(q_mean(q, False) * cq) if per_block_mean else mq)
    qs = smooth_q(turn(q.float() * cq), mq)
    corr = None
    if k_block_mean:
        if rot:
            raise ValueError("k_block_mean does not combine with qk_rotation")
        mkb = k_block_means(k.float() * ck)
        ks = k.float() * ck - mkb[..., torch.arange(sk, device=k.device) // Q_MEAN_BLOCK, :]
        corr = k_block_correction(q.float() * cq, mkb - mk, pad)
    else:
        ks = turn(k.float() * ck) - mk
    qp, qsc = quantize_rows(pad_dim(qs, -2, pad), search)
    kp, ksc = quantize_rows(pad_dim(ks, -2, pad), search)
    vq = _quantize_v(pad_dim(v.float(), -2, pad), flag(v_tile_exponent, "v_tile_exponent") and d % V_GROUP == 0)
    dk = pad_dim(delta_s(mg, ks).squeeze(-2), -1, pad)
    kr = quantize_residual(pad_dim(ks, -2, pad), kp, ksc) if per_block_mean else None
    pre = Preprocessed(qp, qsc, kp, ksc, *vq[:2], mq, mk, sq, sk, mg, dk, rot, bal, search, kr, k_block_corr=corr,
                       v_exp=vq[2])
    if pv == "fp8":
        pre.v8, pre.v8_scales = quantize_mxfp8_transposed(pad_dim(v.float(), -2, pad))
    if precision != "fp4":
        if not fp8_applies(rot, d):
            if precision == "fp8":
                raise ValueError(fp8_unavailable(rot, d))
            return pre
        pre.qk_error = qk_fp4_error(q, k, v, pre, sm_scale)
        pre.qk_fp8 = choose_qk_precision(precision, pre.qk_error, rule_limit(q.shape[2]))
        _raw_rule(q, k, pre, sm_scale)
        _pv_rule(q, k, v, pre, pv, pad, sm_scale, pv_limit, is_causal)
        if qk_fp8_rotated and not rot and rotation_applies(d) and not k_block_mean:
            qs, ks = fp8_rows(q.float() * cq, mq, k.float() * ck, mk)
        (pre.q8, pre.q8_scales), (pre.k8, pre.k8_scales) = (_precise_rows(pad_dim(x, -2, pad)) for x in (qs, ks))
    return pre


def _precise_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The operand of the heads that leave FP4: bf16 rows at D 64 (``qk16_rows``, no scales),
    MXFP8 rows otherwise (``quantize_mxfp8_rows``)."""
    return (qk16_rows(x), None) if x.shape[-1] == QK16_HEAD_DIM else quantize_mxfp8_rows(x)


def _raw_rule(q, k, pre: Preprocessed, sm_scale) -> None:
    """At D 128, where the rule ran: its second statistic and the heads it gives the raw 16-bit rows
    (``raw16_fits``: none where Q or K has fewer rows than a TMA box)."""
    if raw16_fits(q, k):
        pre.qk16_stat = qk16_stat(q, k, pre, sm_scale)
        pre.qk16 = choose_qk16(pre.qk_fp8, pre.qk16_stat, q.shape[-1])
        pre.q16, pre.k16 = q, k


def raw16_fits(q, k) -> bool:
    """Whether the raw 16-bit rows can serve this call: head dim ``QK16_RAW_HEAD_DIM``, and Q and K
    each hold at least ``QK16_MIN_ROWS`` rows (batch x heads x sequence), one TMA box of the
    kernels."""
    from sageattn3 import reference as _package

    rows = lambda x: x.shape[0] * x.shape[1] * x.shape[2]  # noqa: E731
    return (q.shape[-1] == QK16_RAW_HEAD_DIM and rows(q) >= _package.QK16_MIN_ROWS
            and rows(k) >= _package.QK16_MIN_ROWS)


def _pv_rule(q, k, v, pre: Preprocessed, pv: str, pad: int, sm_scale, pv_limit, is_causal: bool = False) -> None:
    """Where the rule runs, with pv_precision "auto" (and ``pad`` a multiple of 32): P's estimate, the
    heads it gives FP8 P·V, V's MXFP8. A negative ``pv_limit`` turns it off (as the kernels' op)."""
    if pv != "auto" or pad % MX_BLOCK or (pv_limit is not None and pv_limit < 0):
        return
    pre.pv_error = pv_p_error(q, k, v, pre, sm_scale, is_causal)
    pre.pv_fp8 = choose_pv_precision("auto", pre.pv_error, pv_limit)
    pre.v8, pre.v8_scales = quantize_mxfp8_transposed(pad_dim(v.float(), -2, pad))


def fp8_rows(qb: torch.Tensor, mean_q: torch.Tensor, kb: torch.Tensor, mean_k: torch.Tensor):
    """The rows FP8 Q·Kᵀ multiplies when the preprocessing did not rotate (D 64/128): the balanced
    rows qb, kb rotated (``rotate``), minus their rotated means (``rotate`` of the unrotated
    ``mean_q`` / ``mean_k``, one row per Q block), float32; Q's then times 64/D (exact: a power of
    two), so that Q8 · K8ᵀ ≈ Q_s · K_sᵀ in the unrotated units the correction delta_s and the
    softmax scale keep (``rotation_score_factor``). The rotation spreads channels that Q and K
    share outliers in over every 32-channel MXFP8 block."""
    d = qb.shape[-1]
    qs = smooth_q(rotate(qb), rotate(mean_q)) * (64.0 / d)
    return qs, rotate(kb) - rotate(mean_k)
