"""NVFP4 quantization and the fused preprocessing (smoothing + NVFP4 of Q, K, V): the public
``scale_and_quant_fp4*`` and ``preprocess`` (re-exported by ``sageattn3.api``) and the kernel
path the FP4 attention calls directly."""

from __future__ import annotations

import torch

from sageattn3 import _kernels, reference
from sageattn3._validate import _QUANT_DTYPES, _check_qkv, _check_tensor, _flags, _search
from sageattn3.reference import Preprocessed

# ---------------------------------------------------------------------------------------------
# Quantization
# ---------------------------------------------------------------------------------------------


def _kernels_serve(device: torch.device) -> bool:
    return _kernels.kernels_run_on(device) is None


_kernels_serve._dynamo_marked_constant = True  # decided while tracing (see api._compile_path)


def _use_kernels(x: torch.Tensor) -> bool:
    return x.device.type == "cuda" and _kernels_serve(x.device)


def scale_and_quant_fp4(x):
    """NVFP4 quantization along the last dim of x (..., D), D a multiple of 16; float16,
    bfloat16 or float32; any device (CUDA kernels where built, else the exact reference).

    Returns ``(packed, scales)``:
    - packed: uint8 (..., D/2), row-major; byte i of a row holds elements 2i (low nibble) and
      2i+1 (high nibble) as E2M1 codes (bit 3 = sign, magnitudes 0,0.5,1,1.5,2,3,4,6).
    - scales: float8_e4m3fn (..., D/16), row-major; scale j covers elements 16j..16j+15.
    Value = E2M1(code) * scale. Rounding, saturation and NaN/Inf: ``sageattn3.reference``."""
    _check_tensor(x, "x", _QUANT_DTYPES)
    if x.shape[-1] % 16:
        raise ValueError(f"x's last dim ({x.shape[-1]}) must be a multiple of 16")
    if _use_kernels(x) and x.numel():
        return _kernels.quant_rows(_kernels.aligned(x))
    return reference.quantize_rows(x)


def scale_and_quant_fp4_permute(x):
    """The layout the FP4 attention kernel consumes for Q and K. At present it is exactly the
    row-major layout of ``scale_and_quant_fp4``: x (..., S, D) -> packed uint8 (..., S, D/2)
    (byte i of row s: elements 2i low nibble, 2i+1 high nibble) and scales float8_e4m3fn
    (..., S, D/16) (scale j of row s covers elements 16j..16j+15). Consume it through this
    function, not by assumption: the kernel may adopt a permuted layout later."""
    _check_tensor(x, "x", _QUANT_DTYPES, min_dim=2)
    return scale_and_quant_fp4(x)


def scale_and_quant_fp4_transpose(x):
    """NVFP4 quantization along the sequence (the layout of V): x (..., S, D) with D a
    multiple of 16 -> packed uint8 (..., D, S16/2) and scales float8_e4m3fn (..., D, S16/16),
    where S16 is S rounded up to a multiple of 16 and the padding tokens are zeros (codes 0 and
    scale 0 when a whole 16-block is padding). Row d of packed holds tokens 2i (low nibble)
    and 2i+1 (high nibble) of channel d; scale j of row d covers tokens 16j..16j+15."""
    _check_tensor(x, "x", _QUANT_DTYPES, min_dim=2)
    if x.shape[-1] % 16:
        raise ValueError(f"x's last dim ({x.shape[-1]}) must be a multiple of 16")
    if _use_kernels(x) and x.numel():
        return _kernels.quant_cols(_kernels.aligned(x))
    return reference.quantize_transposed(x)


# ---------------------------------------------------------------------------------------------
# Fused preprocessing
# ---------------------------------------------------------------------------------------------


def preprocess(q, k, v, per_block_mean: bool = True, pad: int = 128,
               qk_rotation: bool = reference.QK_ROTATION_DEFAULT,
               qk_balance: bool = reference.QK_BALANCE_DEFAULT, qk_scale_search: bool | None = None) -> Preprocessed:
    """Smoothing + NVFP4 quantization of Q, K, V for the attention kernel (never modifies the
    inputs). Layouts and the definition of every output: ``sageattn3.reference.Preprocessed``.

    On CUDA with the kernels (at head dims 64/128 with up to ``_kernels.max_correction_heads`` q
    heads per kv head, one op, ``torch.ops.sageattn3.preprocess_qkv``, allocates every output
    and makes these launches from C++):
    1. V along the sequence (transposed through shared memory), with V's power-of-two exponent
       per tile of 128 keys and 32 channels (``Preprocessed.v_exp``: the codes are those of
       V · 2^e, so that no block of V vanishes or clips; the attention divides it out);
    2. two small launches read up to 8 evenly spaced 128-row blocks of each head of Q and K and
       make K's mean, each q head's mean_q_global (``reference.sample_mean``) and, with the
       balance, its exponents from them;
    3. one launch smooths and quantizes every 128-row tile of Q and K, each from one read into
       registers: Q's tiles with their block means (per_block_mean) or mean_q_global, K's with
       K's mean; K's tiles also write delta_key = mean_q_global · K_sᵀ per key and q head (the
       unquantized smoothed row as quantized, from registers) and, with per_block_mean, K's
       quantization residual (``reference.quantize_residual``, a float16 per element); the
       attention launch adds the block residuals' part from both: precomputed per query block
       and key into a bounded workspace before the attention kernel, or per K tile in it
       (``Preprocessed.delta_s`` materialises it all; ``_attn.delta_s_workspace``).
    ``qk_rotation`` (D 64/128): Q and K rows are rotated in registers before smoothing.
    ``qk_balance=True`` (D 64/128, per_block_mean; off by default): the channel balance
    (``reference.balance_exponents``) from the same sampled blocks; Q and K are scaled by it in
    registers (``Preprocessed.balance``), before the rotation when both are on.
    ``qk_scale_search=True`` (D 64/128; None: ``reference.QK_SCALE_SEARCH``, off unless set, and
    on with ``qk_rotation``: ``reference.scale_search_on``): Q and K quantized with the NVFP4
    scale search (``reference.quantize_rows``).
    Bytes that must move: Q, K, V read (3 x 2 bytes/element) + FP4 written (3 x 0.5625) + the
    sampled blocks (up to 8 x 128 rows per head) and the means, + with per_block_mean K's
    residual written (2 bytes per element of K). Figures:
    tests/bench/bench_kernels.py. Elsewhere: the reference."""
    _check_qkv(q, k, v)
    per_block_mean, qk_rotation, qk_balance = _flags(per_block_mean=per_block_mean, qk_rotation=qk_rotation,
                                                     qk_balance=qk_balance)
    if not isinstance(pad, int) or pad <= 0 or pad % 16:
        raise ValueError(f"pad must be a positive multiple of 16, got {pad!r}")
    if not _use_kernels(q) or q.shape[2] == 0 or q.shape[0] == 0 or q.shape[1] == 0:
        return reference.preprocess(q, k, v, per_block_mean, pad, qk_rotation=qk_rotation, qk_balance=qk_balance,
                                    qk_scale_search=_search(qk_scale_search, qk_rotation))
    d = q.shape[3]
    if d % 16 or d > 256:
        raise ValueError(f"head_dim {d} not supported by the preprocessing kernels (multiple of 16, <= 256)")
    return _preprocess_kernels(q, k, v, per_block_mean, pad, qk_rotation, qk_balance,
                               _search(qk_scale_search, qk_rotation))


def _preprocess_kernels(q, k, v, per_block_mean: bool, pad: int, qk_rotation: bool,
                        qk_balance: bool = reference.QK_BALANCE_DEFAULT, qk_scale_search: bool = False,
                        inputs_aligned: bool = False) -> Preprocessed:
    """``preprocess`` on the kernels, for checked inputs (the FP4 path calls it directly). At
    head dims 64/128 with up to ``max_correction_heads`` q heads per kv head (the attention
    kernel's cases) one op allocates every output and makes every launch in C++, V's first;
    elsewhere V's launch still comes first, before any other Python: the host work for Q and K
    then overlaps it. ``inputs_aligned``: q, k, v are contiguous and 16-byte aligned already
    (``_kernels.aligned``), as the FP4 path passes them."""
    b, hq, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    if type(qk_scale_search) is not bool:  # resolved by the caller (_search: None takes the rotation into account)
        raise TypeError(f"_preprocess_kernels: qk_scale_search must be a resolved bool, got {qk_scale_search!r}")
    if d in reference.ROTATION_HEAD_DIMS and hq // hk <= _kernels.max_correction_heads(d):
        rot, bal, search = kernel_options(d, per_block_mean, qk_rotation, qk_balance, qk_scale_search)
        if not inputs_aligned:
            q, k, v = _kernels.aligned(q), _kernels.aligned(k), _kernels.aligned(v)
        qp, qsc, kp, ksc, vp, vsc, mean_q, mean_k, qbar, ds_key, exps, k_res, v_exp = _kernels.preprocess_qkv(
            q, k, v, pad, per_block_mean, rot, bal, search)
        return Preprocessed(qp, qsc, kp, ksc, vp, vsc, mean_q, mean_k, sq, sk, qbar if per_block_mean else mean_q,
                            ds_key, rot, exps if bal else None, search, k_res if per_block_mean else None,
                            v_exp=v_exp.view(torch.int8))
    # the rest: head dims other than 64/128, or more q heads per kv head than the K kernels take
    # for the per-key correction (delta_key from torch ops then)
    vq = _kernels.quant_cols(_kernels.aligned(v), pad, exps=d % reference.V_GROUP == 0)  # V's exponents as the reference
    vp, vsc, v_exp = vq if len(vq) == 3 else (*vq, None)
    q, k = _kernels.aligned(q), _kernels.aligned(k)
    k3, q3 = k.view(b * hk, sk, d), q.view(b * hq, sq, d)
    rot, bal, search = kernel_options(d, per_block_mean, qk_rotation, qk_balance, qk_scale_search)
    exps = None
    if bal:
        # balanced float32 copies (exact: powers of two), so that every kernel below works in
        # the balanced space as the one op does
        exps = _kernels.qk_balance(q3, k3)
        ck = torch.exp2(exps)
        q3 = (q3.view(b * hk, hq // hk, sq, d).float() * (1.0 / ck).unsqueeze(1)).view(b * hq, sq, d)
        k3 = k3.float() * ck
        q, k = q3.view(b, hq, sq, d), k3.view(b, hk, sk, d)
    if per_block_mean:
        qp, qsc, mean_q, kp, ksc, mean_k = _kernels.smooth_quant_qk(q3, k3, pad, rotate=rot, search=search)
        qbar = None
    else:
        qp, qsc, mean_q = _kernels.smooth_quant_seq(q3, pad, rotate=rot, search=search)
        kp, ksc, mean_k = _kernels.smooth_quant_seq(k3, pad, rotate=rot, search=search)
        qbar = mean_q
    qbar, ds_key, ks = _delta_key_torch(q, k, qbar, mean_k, rot, kp.shape[1])
    # K's quantization residual from the same float32 rows the kernels quantized (bit-exact)
    k_res = reference.quantize_residual(ks, kp, ksc) if per_block_mean else None
    return Preprocessed(
        qp.view(b, hq, -1, d // 2), qsc.view(b, hq, -1, d // 16),
        kp.view(b, hk, -1, d // 2), ksc.view(b, hk, -1, d // 16),
        vp, vsc, mean_q.view(b, hq, -1, d), mean_k.view(b, hk, 1, d), sq, sk,
        qbar.view(b, hq, 1, d), ds_key.view(b, hq, -1), rot, None if exps is None else exps.view(b, hk, 1, d),
        search, None if k_res is None else k_res.view(b, hk, -1, d), v_exp=v_exp,
    )


def kernel_options(d: int, per_block_mean: bool, qk_rotation: bool, qk_balance: bool,
                   qk_scale_search: bool) -> tuple[bool, bool, bool]:
    """(rotation, balance, scale search) as the preprocessing kernels take them at head dim ``d``:
    each where it applies (the balance with per-block Q means)."""
    return (bool(qk_rotation) and d in reference.ROTATION_HEAD_DIMS,
            bool(qk_balance) and per_block_mean and reference.balance_applies(d),
            reference.scale_search_applies(qk_scale_search, d))


def _delta_key_torch(q, k, qbar, mean_k, rot: bool, skp: int):
    """mean_q_global and delta_key with torch ops, where the K kernels do not compute them
    (head dims other than 64/128; more q heads per kv head than they take): (B*Hq, 1, D) and
    (B*Hq, Skp) float32, the reference's definition (in float32): qbar · (rotated K - mean_k);
    and that smoothed K, (B*Hkv, Skp, D) float32 (zero rows past Sk)."""
    b, hq, sq, d = q.shape
    hk = k.shape[1]
    turn = reference.rotate if rot else (lambda x: x.float())
    if qbar is None:
        qbar = turn(reference.sample_mean(q))
    qbar = qbar.reshape(b, hq, 1, d)
    ks = turn(k) - mean_k.reshape(b, hk, 1, d)
    ds = torch.matmul(qbar, reference.expand_kv(ks, hq).transpose(-1, -2)).squeeze(-2)
    ds = reference.pad_dim(ds, -1, skp)
    return qbar.reshape(b * hq, 1, d), ds.reshape(b * hq, skp), reference.pad_dim(ks, -2, skp).reshape(b * hk, skp, d)
