"""The FP4 attention kernel (csrc/attn) from Python: input checks and the call of
``torch.ops.sageattn3.blockscaled_fp4_attn``, plus the probe of the FP4 MMA instruction.

Inputs are what ``sageattn3.reference.Preprocessed`` / ``sageattn3.api.preprocess(pad=128)``
produce (all sequence dims padded with zeros to a multiple of 128):

- q (B, Hq, Sq_p, D/2) uint8 + q_sf (B, Hq, Sq_p, D/16) e4m3: Q minus its mean(s), NVFP4 along D
  (``scale_and_quant_fp4_permute`` layout: row-major, low nibble = even element);
- k (B, Hkv, Sk_p, D/2) + k_sf (B, Hkv, Sk_p, D/16): K minus its mean, same layout;
- v (B, Hkv, D, Sk_p/2) + v_sf (B, Hkv, D, Sk_p/16): V along the sequence
  (``scale_and_quant_fp4_transpose`` layout);
- mean_q (B, Hq, nblk, D) float32, nblk = Sq_p/128 (per-block Q means) or 1: the Q means
  removed from q; mean_q_global (B, Hq, 1, D) float32: Q's mean for the whole sequence
  (``reference.sample_mean``); delta_key (B, Hq, Sk_p) float32: mean_q_global · K_sᵀ per key
  (the unquantized smoothed K, from preprocessing); k_residual (B, Hkv, Sk_p, D) float16:
  K's quantization residual (``reference.quantize_residual``; needed with per-block Q means). The
  kernel adds delta_s = delta_key + (mean_q - mean_q_global) · K̂ᵀ (K̂ =
  ``reference.dequantize_rows`` of k with the residual, or of k alone without it) to Q·Kᵀ before the
  softmax scale (query row i uses mean i // 128, or 0). With per-block Q means the second term is
  precomputed per query block and key into a workspace (``delta_s_workspace``: ceil(Sq/128) x
  Sk_p floats per (batch, q head), in chunks of heads that fit ``SAGEATTN3_DELTA_S_WORKSPACE_MIB``,
  default 512); where one head alone does not fit, the kernel computes it per 128-key tile in its
  loop instead (slower, no workspace). Both give the same delta_s bit for bit.
- With Q/K rotation (``reference.rotate``) the scores are (D/64)·Q·Kᵀ: the softmax scale is
  divided by that factor (``qk_rotation=True``).

The kernel computes ``sageattn3.reference.sageattn3`` with block_n = 128: online softmax in the
exp2 domain, P = exp2(t - m_running)·2688 (level 1, folded into the exponent), NVFP4 of P along
the keys (level 2), row sums of the unquantized P; causal = top-left aligned (key j visible to
query i iff j <= i). D = 64 or 128; GQA/MQA (Hq a multiple of Hkv).
"""

from __future__ import annotations

import math
import os

import torch

from sageattn3 import _kernels, reference

HEAD_DIMS = (64, 128)
SEQ_PAD = 128  # the kernel's tile along both sequences


WORKSPACE_ENV = "SAGEATTN3_DELTA_S_WORKSPACE_MIB"
WORKSPACE_DEFAULT_MIB = 512


def _ops():
    return torch.ops.sageattn3


def delta_s_workspace_limit() -> int:
    """The most bytes the precomputed delta_s may take (``SAGEATTN3_DELTA_S_WORKSPACE_MIB``, MiB;
    default 512; 0 keeps the kernel's in-loop correction always)."""
    raw = os.environ.get(WORKSPACE_ENV, "").strip()
    if not raw:
        return WORKSPACE_DEFAULT_MIB << 20
    try:
        mib = int(raw)
    except ValueError:
        mib = -1
    if mib < 0:
        raise ValueError(f"{WORKSPACE_ENV}={raw!r}: expected a whole number of MiB >= 0 (the most memory the "
                         f"precomputed delta_s may take; 0: none, the kernel corrects in its loop), e.g. "
                         f"{WORKSPACE_ENV}={WORKSPACE_DEFAULT_MIB}")
    return mib << 20


def delta_s_workspace(batch: int, heads_q: int, nblk: int, seq_q: int, seq_k_pad: int,
                      device: torch.device, limit: int | None = None) -> torch.Tensor:
    """The workspace of delta_s per query block and key: whole (batch, q head) rows of
    ceil(seq_q/128) x seq_k_pad floats, as many as ``limit`` bytes hold (default:
    ``delta_s_workspace_limit()``; all of them at most); empty with one Q mean or when not even
    one row fits (the kernel then corrects in its loop). Shapes only: no synchronisation."""
    row = -(-seq_q // SEQ_PAD) * seq_k_pad
    if nblk == 1:
        return _kernels._none(device, 7)
    rows = min(batch * heads_q, (delta_s_workspace_limit() if limit is None else limit) // (4 * row))
    if rows < 1:
        return _kernels._none(device, 7)
    return torch.empty(rows * row, dtype=torch.float32, device=device)


def has_kernel() -> bool:
    try:
        return hasattr(_ops(), "blockscaled_fp4_attn")
    except (AttributeError, RuntimeError):
        return False


def _bytes(x: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype == torch.float8_e4m3fn:
        x = x.view(torch.uint8)
    if x.dtype != torch.uint8:
        raise TypeError(f"{name} must be uint8 or float8_e4m3fn, got {x.dtype}")
    return x.contiguous()


def qk_operands(q8, q8_scales, k8, k8_scales) -> tuple:
    """The precise Q·Kᵀ rung's operands as the attention ops take them: MXFP8 codes and scales (D
    128) as they are; bfloat16 rows (D 64: ``reference.qk16_rows``) as their bytes (..., 2D), their
    scales an empty uint8 tensor (``_kernels.mxfp8_smooth_quant_qk`` returns them so already)."""
    def one(x, s, name):
        if isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16:
            x = x.contiguous().view(torch.uint8)
            s = x.new_empty((*x.shape[:-1], 0)) if s is None else s  # (B, H, Sp, 0) uint8
        return _bytes(x, name), s
    return (*one(q8, q8_scales, "q8"), *one(k8, k8_scales, "k8"))


def _pad_seq(x: torch.Tensor, dim: int, multiple: int = SEQ_PAD) -> torch.Tensor:
    size = x.shape[dim]
    target = -(-size // multiple) * multiple
    if target == size:
        return x
    pad_shape = list(x.shape)
    pad_shape[dim] = target - size
    return torch.cat((x, x.new_zeros(pad_shape)), dim=dim)


def _pad_to(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    if x.shape[dim] >= size:
        return x
    pad_shape = list(x.shape)
    pad_shape[dim] = size - x.shape[dim]
    return torch.cat((x, x.new_zeros(pad_shape)), dim=dim)


def fp4_attention(
    q: torch.Tensor,
    q_sf: torch.Tensor,
    k: torch.Tensor,
    k_sf: torch.Tensor,
    v: torch.Tensor,
    v_sf: torch.Tensor,
    mean_q: torch.Tensor,
    *,
    mean_q_global: torch.Tensor,
    delta_key: torch.Tensor,
    k_residual: torch.Tensor | None = None,
    seq_q: int,
    seq_k: int,
    sm_scale: float | None = None,
    is_causal: bool = False,
    out_dtype: torch.dtype = torch.bfloat16,
    qk_rotation: bool = False,
    v_exp: torch.Tensor | None = None,
) -> torch.Tensor:
    """Runs the FP4 attention kernel on preprocessed NVFP4 tensors (layouts: module doc) and
    returns (B, Hq, seq_q, D) in ``out_dtype`` (bfloat16 or float16). Sequence dims that are
    not yet multiples of 128 are zero-padded here (a copy); ``seq_q``/``seq_k`` are the real
    lengths (keys past seq_k are masked, rows past seq_q are not written). ``qk_rotation``: q and
    k were rotated (the scale is divided by D/64). ``k_residual`` is required with per-block Q
    means (mean_q with more than one row). With one mean_q row it is optional: preprocessing
    then gives mean_q == mean_q_global and there is nothing for it to correct; a caller whose one
    mean_q row differs from mean_q_global should pass it, or that difference multiplies the
    quantized K alone (r · Kdᵀ, as ``reference.Preprocessed.delta_s`` computes without a
    residual) instead of the paper's r · K_sᵀ. ``v_exp`` (B, Hkv, Sk_p/128, D/32) int8: V's tile
    exponents (``reference.Preprocessed.v_exp``) when v and v_sf are the NVFP4 of V · 2^e
    (``reference.quantize_transposed_tiled``), each in [-40, 40] as the preprocessing writes them
    (the kernel does not check them); None: every exponent 0 (plain NVFP4 of V)."""
    q, q_sf, k, k_sf = _bytes(q, "q"), _bytes(q_sf, "q_sf"), _bytes(k, "k"), _bytes(k_sf, "k_sf")
    v, v_sf = _bytes(v, "v"), _bytes(v_sf, "v_sf")
    for name, t in (("q", q), ("q_sf", q_sf), ("k", k), ("k_sf", k_sf), ("v", v), ("v_sf", v_sf), ("mean_q", mean_q),
                    ("mean_q_global", mean_q_global)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D, got shape {tuple(t.shape)}")
        if t.device != q.device or t.device.type != "cuda":
            raise ValueError(f"{name} must be a CUDA tensor on q's device ({q.device}), got {t.device}")
    for name, t in (("mean_q", mean_q), ("mean_q_global", mean_q_global), ("delta_key", delta_key)):
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {t.dtype}")
    if out_dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"out_dtype must be bfloat16 or float16, got {out_dtype}")
    b, hq, _, d2 = q.shape
    d = 2 * d2
    if d not in HEAD_DIMS:
        raise ValueError(f"head_dim {d} is not supported by the FP4 kernel ({'/'.join(map(str, HEAD_DIMS))})")
    hk = k.shape[1]
    if hk == 0 or hq % hk:
        raise ValueError(f"q heads ({hq}) must be a multiple of k/v heads ({hk})")
    if not (1 <= seq_q <= q.shape[2]) or not (1 <= seq_k <= k.shape[2]):
        raise ValueError(f"seq_q={seq_q} / seq_k={seq_k} do not fit q ({q.shape[2]} rows) / k ({k.shape[2]} rows)")
    if v.shape[:3] != (b, hk, d) or v_sf.shape[:3] != (b, hk, d):
        raise ValueError(f"v/v_sf must be (B, Hkv, D, ...) = ({b}, {hk}, {d}, ...), got {tuple(v.shape)} / {tuple(v_sf.shape)}")
    q, q_sf = _pad_seq(q, 2), _pad_seq(q_sf, 2)
    k, k_sf = _pad_seq(k, 2), _pad_seq(k_sf, 2)
    sk_p = k.shape[2]
    if v.shape[3] * 2 > sk_p or v_sf.shape[3] * 16 > sk_p:
        raise ValueError(f"v covers more keys ({v.shape[3] * 2}) than k ({sk_p})")
    v_exp = _v_exp(v_exp, b, hk, v.shape[3] * 2, sk_p, d, q.device)
    v, v_sf = _pad_to(v, 3, sk_p // 2), _pad_to(v_sf, 3, sk_p // 16)
    mean_q = _kernels.aligned(mean_q)
    nblk = mean_q.shape[2]
    if mean_q.shape[:2] != (b, hq) or mean_q.shape[3] != d or nblk not in (1, q.shape[2] // SEQ_PAD):
        raise ValueError(
            f"mean_q must be (B, Hq, 1 or Sq_p/128, D) = ({b}, {hq}, 1|{q.shape[2] // SEQ_PAD}, {d}), "
            f"got {tuple(mean_q.shape)}"
        )
    mean_q_global = _kernels.aligned(mean_q_global)
    if mean_q_global.shape != (b, hq, 1, d):
        raise ValueError(f"mean_q_global must be (B, Hq, 1, D) = ({b}, {hq}, 1, {d}), got {tuple(mean_q_global.shape)}")
    if delta_key.dim() != 3 or delta_key.shape[:2] != (b, hq) or delta_key.device != q.device:
        raise ValueError(f"delta_key must be (B, Hq, Sk_p) = ({b}, {hq}, ...) on {q.device}, got {tuple(delta_key.shape)}")
    if delta_key.shape[2] > sk_p:
        raise ValueError(f"delta_key covers more keys ({delta_key.shape[2]}) than k ({sk_p})")
    delta_key = _pad_to(delta_key, 2, sk_p).contiguous()
    if k_residual is None:
        if nblk > 1:
            raise ValueError("k_residual (K's quantization residual, Preprocessed.k_residual) is required with "
                             "per-block Q means (mean_q with more than one row)")
    else:
        if not isinstance(k_residual, torch.Tensor) or k_residual.dtype != torch.float16:
            raise TypeError("k_residual must be the float16 tensor reference.quantize_residual or "
                            f"sageattn3.preprocess makes (Preprocessed.k_residual), got "
                            f"{getattr(k_residual, 'dtype', type(k_residual).__name__)} (a one-byte E4M3 "
                            "residual of an earlier release is in the same units: .to(torch.float16) converts "
                            "it exactly; or run sageattn3.preprocess again)")
        if k_residual.dim() != 4 or k_residual.shape[:2] != (b, hk) or k_residual.shape[3] != d \
                or k_residual.device != q.device:
            raise ValueError(f"k_residual must be (B, Hkv, Sk_p, D) = ({b}, {hk}, ..., {d}) on {q.device}, "
                             f"got {tuple(k_residual.shape)}")
        if k_residual.shape[2] > sk_p:
            raise ValueError(f"k_residual covers more keys ({k_residual.shape[2]}) than k ({sk_p})")
        k_residual = _kernels.aligned(_pad_to(k_residual, 2, sk_p))
    return _launch(q, q_sf, k, k_sf, v.contiguous(), v_sf.contiguous(), mean_q, mean_q_global, delta_key, int(seq_q),
                   int(seq_k), sm_scale, bool(is_causal), out_dtype, bool(qk_rotation), k_residual, v_exp=v_exp)


def _v_exp(v_exp: torch.Tensor | None, b: int, hk: int, v_keys: int, sk_p: int, d: int,
           device: torch.device) -> torch.Tensor | None:
    """V's tile exponents checked against v (v_keys keys: one exponent tile per 128 of them) and
    zero-padded to sk_p / 128 tiles (the padding keys' codes are zeros), as uint8 (the op's bytes)."""
    if v_exp is None:
        return None
    if not isinstance(v_exp, torch.Tensor) or v_exp.dtype not in (torch.int8, torch.uint8):
        raise TypeError(f"v_exp must be an int8 tensor (Preprocessed.v_exp), got {getattr(v_exp, 'dtype', type(v_exp))}")
    tiles = -(-v_keys // 128)
    if v_exp.dim() != 4 or v_exp.shape != (b, hk, tiles, d // 32) or v_exp.device != device:
        raise ValueError(f"v_exp must be (B, Hkv, ceil(v's keys / 128), D/32) = ({b}, {hk}, {tiles}, {d // 32}) on "
                         f"{device}, got {tuple(v_exp.shape)} on {v_exp.device}")
    return _kernels.aligned(_pad_to(v_exp.view(torch.uint8), 2, sk_p // 128))


def attention_scale(d: int, sm_scale: float | None, rotated: bool) -> float:
    """The softmax scale the attention kernels take: ``sm_scale`` (default 1/sqrt(D)), divided by
    D/64 on rotated rows (rotate(q) . rotate(k) = (D/64) q . k; exact, a power of two)."""
    scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(d)
    return scale * 64.0 / d if rotated else scale


QK8_WORKSPACE_REFUSAL = ("the FP8 Q·Kᵀ kernel needs the delta_s workspace to hold one (batch, head) row "
                         f"({WORKSPACE_ENV} is too small for these sequence lengths)")
PV8_WORKSPACE_REFUSAL = ("the FP8 P·V kernel needs the delta_s workspace to hold one (batch, q head) row: raise "
                         f"{WORKSPACE_ENV} or pass per_block_mean=False")


def _launch(q, q_sf, k, k_sf, v, v_sf, mean_q, mean_q_global, delta_key, seq_q: int, seq_k: int,
            sm_scale: float | None, is_causal: bool, out_dtype: torch.dtype, qk_rotation: bool,
            k_residual: torch.Tensor | None = None, workspace_limit: int | None = None,
            v_exp: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel call itself, on operands in the kernel's layout (the op checks them again);
    ``workspace_limit``: ``delta_s_workspace``'s ``limit``; ``v_exp``: V's tile exponents
    (uint8 or int8) or None."""
    d = 2 * q.shape[3]
    scale = attention_scale(d, sm_scale, qk_rotation)
    out = torch.empty((q.shape[0], q.shape[1], seq_q, d), dtype=out_dtype, device=q.device)
    k_res = _kernels._none(q.device, 6) if k_residual is None else k_residual
    work = delta_s_workspace(q.shape[0], q.shape[1], mean_q.shape[2], seq_q, k.shape[2], q.device, workspace_limit)
    _kernels.op("blockscaled_fp4_attn")(q, q_sf, k, k_sf, v, v_sf, v_exp_bytes(v_exp, q.device), mean_q, mean_q_global,
                                        delta_key, k_res, work, out, seq_q, seq_k, scale, is_causal)
    return out


def v_exp_bytes(v_exp: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The attention ops' v_exp operand: V's tile exponents as uint8, or an empty tensor (all 0)."""
    return _kernels._none(device, 13) if v_exp is None else v_exp.view(torch.uint8)


def fp8_workspace_fits(batch: int, heads_q: int, nblk: int, seq_q: int, seq_k_pad: int,
                       limit: int | None = None) -> bool:
    """Whether the FP8 Q·Kᵀ kernel can run: it reads delta_s rows, so with per-block Q means the
    workspace (``limit`` bytes, default ``delta_s_workspace_limit()``) must hold at least one
    (batch, q head) row (the bounded-memory mode is FP4 only)."""
    if nblk == 1:
        return True
    return (delta_s_workspace_limit() if limit is None else limit) // (4 * -(-seq_q // SEQ_PAD) * seq_k_pad) >= 1


def attention_qk8(pre, head_sel: torch.Tensor, q8: torch.Tensor, q8_scales: torch.Tensor, k8: torch.Tensor,
                  k8_scales: torch.Tensor, *, is_causal: bool = False, sm_scale: float | None = None,
                  out_dtype: torch.dtype = torch.bfloat16, workspace_limit: int | None = None,
                  raw: tuple | None = None) -> torch.Tensor:
    """The attention with the per-head Q·Kᵀ precision, on a ``reference.Preprocessed`` straight from
    the preprocessing kernels (pad=128): head_sel (B, Hq) bool/uint8, 1 where the
    head's Q·Kᵀ runs in FP8 from q8/k8 (MXFP8 of the same smoothed rows, rotated, at D 128; at D 64
    their bfloat16 rows, the 16-bit Q·Kᵀ: ``qk_operands``;
    ``_kernels.mxfp8_smooth_quant_qk``; only the selected heads' rows, and the kv heads any
    selected q head reads, need be filled). Two launches, each skipping the other's heads on the
    device; one where head_sel is all zeros is FP4's output bit for bit. With the rotation
    (``pre.qk_rotation``) q8/k8 are MXFP8 of the rows the preprocessing rotated and the softmax
    scale is divided by D/64, as for FP4; without it q8 carries the 64/D itself
    (``reference.fp8_rows``) and the scale is the plain one. ``workspace_limit``:
    ``delta_s_workspace``'s ``limit``. ``raw``: at D 128 the call's (q, k), contiguous and 16-byte
    aligned, for the heads whose head_sel has bit 2 (the rule's raw 16-bit rows: ``raw_operands``)."""
    q = pre.q_packed
    d = 2 * q.shape[3]
    scale = attention_scale(d, sm_scale, pre.qk_rotation)
    out = torch.empty((q.shape[0], q.shape[1], pre.seq_q, d), dtype=out_dtype, device=q.device)
    k_res = _kernels._none(q.device, 6) if pre.k_residual is None else pre.k_residual
    work = delta_s_workspace(q.shape[0], q.shape[1], pre.mean_q.shape[2], pre.seq_q, pre.k_packed.shape[2], q.device,
                             workspace_limit)
    sel = head_sel if head_sel.dtype == torch.uint8 and head_sel.is_contiguous() else head_sel.to(torch.uint8).contiguous()
    sel = without_raw_bit(sel, raw)
    _kernels.op("blockscaled_attn_qk8")(q, pre.q_scales, pre.k_packed, pre.k_scales, pre.v_packed, pre.v_scales,
                                        v_exp_bytes(pre.v_exp, q.device), pre.mean_q, pre.mean_q_global,
                                        pre.delta_key, k_res, work, out, sel,
                                        *qk_operands(q8, q8_scales, k8, k8_scales),
                                        *raw_operands(raw, d, sm_scale, q.device), pre.seq_q, pre.seq_k, scale,
                                        is_causal)
    return out


def without_raw_bit(sel: torch.Tensor, raw: tuple | None) -> torch.Tensor:
    """Selection bytes for a launch without the raw rows (``raw`` None): bit 2 cleared (on the
    device), so those heads run MXFP8 rather than no kernel at all (bytes 5 and 7 launch only with
    q_raw)."""
    return sel if raw is not None else sel & 3


def raw_operands(raw: tuple | None, d: int, sm_scale: float | None, device: torch.device) -> tuple:
    """The attention ops' (q_raw, k_raw, raw_scale): the call's q and k (``raw``; the heads whose
    head_sel has bit 2 multiply them as they are, D 128) and their softmax scale (unrotated), or
    empty tensors where ``raw`` is None."""
    if raw is None:
        return _kernels._none(device, 14), _kernels._none(device, 15), 0.0
    return raw[0], raw[1], float(sm_scale if sm_scale is not None else 1.0 / math.sqrt(d))


def attention_from_preprocessed(pre, *, is_causal: bool = False, sm_scale: float | None = None,
                                out_dtype: torch.dtype = torch.bfloat16, trusted: bool = False,
                                workspace_limit: int | None = None) -> torch.Tensor:
    """``fp4_attention`` on a ``sageattn3.reference.Preprocessed`` (as ``api.preprocess``
    returns it, pad=128). ``trusted``: ``pre`` comes straight from the preprocessing kernels
    with pad=128 (contiguous, aligned, padded, uint8/e4m3 codes and scales) and out_dtype is
    q's dtype: the Python checks and padding are skipped (the op's own checks remain).
    ``workspace_limit``: ``delta_s_workspace``'s ``limit``."""
    if trusted:
        return _launch(pre.q_packed, pre.q_scales, pre.k_packed, pre.k_scales, pre.v_packed, pre.v_scales,
                       pre.mean_q, pre.mean_q_global, pre.delta_key, pre.seq_q, pre.seq_k, sm_scale, is_causal,
                       out_dtype, pre.qk_rotation, pre.k_residual, workspace_limit, pre.v_exp)
    return fp4_attention(pre.q_packed, pre.q_scales, pre.k_packed, pre.k_scales, pre.v_packed, pre.v_scales,
                         pre.mean_q, mean_q_global=pre.mean_q_global, delta_key=pre.delta_key,
                         k_residual=pre.k_residual, seq_q=pre.seq_q,
                         seq_k=pre.seq_k, sm_scale=sm_scale, is_causal=is_causal, out_dtype=out_dtype,
                         qk_rotation=pre.qk_rotation, v_exp=pre.v_exp)


def mma_probe(a: torch.Tensor, b: torch.Tensor, sfa: torch.Tensor, sfb: torch.Tensor, c: torch.Tensor,
              tid_a: int = 0, tid_b: int = 0) -> torch.Tensor:
    """One block-scaled FP4 MMA (m16n8k64, e2m1, ue4m3 scale_vec::4X) per problem: a (n,16,32)
    bytes = A row-major (16 x 64 codes), b (n,8,32) = B column-major (8 columns x 64 codes),
    sfa (n,16,4) / sfb (n,8,4) scale bytes, c (n,16,8) float32. Returns D (n,16,8) float32.
    The real instruction on sm_120/121, the software model in the test flavour (sm_90)."""
    n = a.shape[0]
    d = torch.empty((n, 16, 8), dtype=torch.float32, device=a.device)
    _ops().fp4_mma_probe(_bytes(a, "a"), _bytes(b, "b"), _bytes(sfa, "sfa"), _bytes(sfb, "sfb"),
                         c.float().contiguous(), d, int(tid_a), int(tid_b))
    return d
