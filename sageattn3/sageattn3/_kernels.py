"""Whether the compiled kernels can run, and thin wrappers over ``torch.ops.sageattn3.*``.

The extension ``sageattn3._C`` is loaded by ``sageattn3/__init__.py``; this module only asks
whether that worked and whether the wheel holds machine code for a given device. The wrappers
allocate the outputs (the ops write into them; ``preprocess_qkv`` allocates its own) and assume
validated, contiguous inputs.
"""

from __future__ import annotations

import functools
import os
import re

import torch

# Set by __init__: None when the extension is loaded, else why it is not.
NOT_LOADED_REASON: str | None = "not initialised"
# Set by __init__ under `python -m sageattn3` only: the ABI guard's refusal or the load error of
# the extension (elsewhere these propagate from `import sageattn3`).
LOAD_ERROR: BaseException | None = None
ARCHS: tuple[str, ...] = ()

ATTN_HEAD_DIMS = (64, 128)  # what the FP4 attention kernel supports
FP4_MMA_CCS = ((12, 0), (12, 1))  # sm_120 / sm_121: block-scaled FP4 mma.sync

# Test-only opt-in: with the MMA-model test flavour installed (the FP4 MMA replaced by its
# software model, built for sm_90a), route GPUs without FP4 MMA (the H100) through the FP4 path.
# Ignored by normal wheels: users on an H100 keep the SDPA fallback.
FORCE_FP4_ENV = "SAGEATTN3_FORCE_FP4"


def loaded() -> bool:
    return NOT_LOADED_REASON is None


def arch_runs_on(arch: str, cc: tuple[int, int]) -> bool:
    """Whether code built for ``arch`` ('sm_120a', 'sm_120f', 'sm_90') runs on compute
    capability ``cc``: 'a' targets only on that exact CC, 'f' targets on the family (same
    major, minor >= theirs), plain targets on the same major with minor >= theirs."""
    m = re.fullmatch(r"sm_(\d+)(\d)([af]?)", arch)
    if not m:
        return False
    major, minor, suffix = int(m.group(1)), int(m.group(2)), m.group(3)
    if suffix == "a":
        return cc == (major, minor)
    return cc[0] == major and cc[1] >= minor


_CC: dict[int, tuple[int, int]] = {}
_RUNS_ON: dict[tuple, str | None] = {}


def device_cc(device: torch.device) -> tuple[int, int]:
    """The device's compute capability (asked once per device: it cannot change)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    cc = _CC.get(index)
    if cc is None:
        cc = _CC[index] = tuple(torch.cuda.get_device_capability(index))
    return cc


def kernels_run_on(device: torch.device) -> str | None:
    """None if the quantization kernels can run on ``device``, else why not (decided once per
    device and load state: every public call asks)."""
    key = (device, NOT_LOADED_REASON, ARCHS)
    try:
        return _RUNS_ON[key]
    except KeyError:
        pass
    if device.type != "cuda":
        why = f"{device.type} tensors"
    elif not loaded():
        why = f"kernels not built ({NOT_LOADED_REASON})"
    else:
        cc = device_cc(device)
        why = None
        if not any(arch_runs_on(a, cc) for a in ARCHS):
            why = f"this build has no code for sm_{cc[0]}{cc[1]} (built for {', '.join(ARCHS) or 'nothing'})"
    if device.type != "cuda" or device.index is not None:
        _RUNS_ON[key] = why
    return why


@functools.cache
def mma_model_build() -> bool:
    """Whether this wheel is the MMA-model test flavour: its build record says so, at the top
    level (standalone `pip wheel` builds) or under ``extra`` (the factory's build record)."""
    from sageattn3._guard import build_record

    rec = build_record()
    extra = rec.get("extra") or {}
    return bool(rec.get("mma_model") or (isinstance(extra, dict) and extra.get("mma_model")))


def force_fp4_requested() -> bool:
    return os.environ.get(FORCE_FP4_ENV, "").strip() == "1"


def has_attention_kernel() -> bool:
    return loaded() and hasattr(torch.ops.sageattn3, "blockscaled_fp4_attn")


def has_rule_kernel() -> bool:
    """Whether the fused "auto" rule kernel (``qk_rule_select``) is built."""
    return loaded() and hasattr(torch.ops.sageattn3, "qk_rule_select")


_op_cache: dict = {}


def op(name: str):
    """``torch.ops.sageattn3.<name>.default``, looked up once: calling the overload directly
    skips the per-call overload resolution of the packet."""
    o = _op_cache.get(name)
    if o is None:
        o = _op_cache[name] = getattr(torch.ops.sageattn3, name).default
    return o


def quant_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    d = x.shape[-1]
    packed = torch.empty((*x.shape[:-1], d // 2), dtype=torch.uint8, device=x.device)
    scales = torch.empty((*x.shape[:-1], d // 16), dtype=torch.float8_e4m3fn, device=x.device)
    op("quant_fp4_rows")(x, packed, scales)
    return packed, scales


def quant_cols(x: torch.Tensor, seq_pad: int = 16, exps: bool = False) -> tuple[torch.Tensor, ...]:
    """x (..., S, D) contiguous -> (..., D, Sp/2), (..., D, Sp/16), Sp = S up to seq_pad; with
    ``exps`` (D a multiple of 32) also V's tile exponents (..., ceil(Sp/128), D/32) int8, the codes
    and scales then those of x · 2^e (``reference.quantize_transposed_tiled``)."""
    *lead, s, d = x.shape
    sp = -(-s // seq_pad) * seq_pad
    dev = x.device
    packed = torch.empty((*lead, d, sp // 2), dtype=torch.uint8, device=dev)
    scales = torch.empty((*lead, d, sp // 16), dtype=torch.float8_e4m3fn, device=dev)
    e = torch.empty((*lead, -(-sp // 128), d // 32), dtype=torch.uint8, device=dev) if exps else _none(dev, 12)
    op("quant_fp4_cols")(x, packed, scales, e)
    return (packed, scales, e.view(torch.int8)) if exps else (packed, scales)


def smooth_quant_rows(x: torch.Tensor, mean: torch.Tensor, compute_mean: bool, mean_block: int,
                      seq_pad: int, rotate: bool = False, search: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x (G, S, D): rows minus mean[g, r // mean_block] (mean_block 0: one mean), NVFP4 along
    D, rows padded with zero codes to a multiple of ``seq_pad``. compute_mean: the kernel
    computes the 128-row means itself and writes them into ``mean``. ``rotate`` (D 64/128): the
    rows are rotated first (``reference.rotate``) and the means are rotated means. ``search``:
    NVFP4 with the scale search (``reference.quantize_rows(..., scale_search=True)``), as every
    smoothing wrapper here takes it."""
    g, s, d = x.shape
    packed, scales = _codes(x, g, s, d, seq_pad)
    op("smooth_quant_rows")(x, mean, compute_mean, mean_block, packed, scales, rotate, search)
    return packed, scales


def smooth_quant_seq(x: torch.Tensor, seq_pad: int, rotate: bool = False, search: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (G, S, D), S >= 1: rows minus their sampled mean (``reference.sample_mean``: up to 8
    evenly spaced 128-row blocks, the sums in a fixed order), NVFP4 along D, rows padded with
    zero codes to a multiple of ``seq_pad``; returns (packed, scales, mean (G, 1, D)). Three
    launches: the sampled blocks' sums, the means, then one read of x to quantize.
    ``rotate`` (D 64/128): rows rotated first, the mean is the rotated mean. ``search`` (D
    64/128): the scale search, as ``smooth_quant_rows``."""
    return _smooth_quant_seq(x, seq_pad, rotate, None, search)[:3]


def smooth_quant_seq_key(x: torch.Tensor, seq_pad: int, qbar: torch.Tensor, rotate: bool = False,
                         search: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``smooth_quant_seq`` of K plus its per-key correction for the q heads of each group:
    qbar (G*rep, 1, D) fp32 (their Q means, rotated with ``rotate``; D 64/128, rep <=
    ``max_correction_heads``) -> also ds_key (G*rep, Sp) = qbar · (the smoothed row as
    quantized) (0 past S)."""
    return _smooth_quant_seq(x, seq_pad, rotate, qbar, search)


def _smooth_quant_seq(x, seq_pad, rotate, qbar, search):
    g, s, d = x.shape
    packed, scales = _codes(x, g, s, d, seq_pad)
    mean = torch.empty((g, 1, d), dtype=torch.float32, device=x.device)
    # room for the sampled tiles' column sums: the first G * min(8, ceil(S/128)) rows are used
    partial = torch.empty((g, -(-s // 128), d), dtype=torch.float32, device=x.device)
    if qbar is None:
        qbar, ds_key = _none(x.device, 0), _none(x.device, 1)
        out = None
    else:
        ds_key = out = torch.empty((qbar.shape[0], packed.shape[1]), dtype=torch.float32, device=x.device)
    op("smooth_quant_seq")(x, mean, partial, packed, scales, rotate, search, qbar, ds_key)
    return packed, scales, mean, out


_NONE: dict = {}


def aligned(x: torch.Tensor) -> torch.Tensor:
    """Contiguous and 16-byte aligned (the kernels use 16-byte vector loads). Under
    torch.compile only contiguous: a traced tensor has no address yet (the ops refuse a
    misaligned one with a clear error)."""
    x = x.contiguous()
    if torch.compiler.is_compiling():
        return x
    return x if x.data_ptr() % 16 == 0 else x.clone()


def aligned_eager(x: torch.Tensor) -> torch.Tensor:
    """``aligned`` where torch.compile never traces (the eager FP4 path, also the body of the
    ``sageattn3::attention`` op at run time): without asking whether it is compiling."""
    x = x.contiguous()
    return x if x.data_ptr() % 16 == 0 else x.clone()


def _none(device: torch.device, i: int) -> torch.Tensor:
    """An empty float32 tensor ("no such operand" for the ops), distinct per operand slot i."""
    t = _NONE.get((device, i))
    if t is None:
        t = _NONE[(device, i)] = torch.empty(0, device=device)
    return t


def max_correction_heads(d: int) -> int:
    """q heads per kv head for which the K kernels compute the per-key correction (their Q
    vectors sit in shared memory, 20 floats per 16 channels): 25 at D 128, 51 at D 64."""
    return 4096 // (d // 16 * 20)


def smooth_quant_qk(q: torch.Tensor, k: torch.Tensor, seq_pad: int, rotate: bool = False, search: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (Gq, Sq, D), k (Gk, Sk, D), Sk >= 1, Gq a multiple of Gk (or 0): Q minus its 128-row
    block means (as ``smooth_quant_rows`` with compute_mean) and K minus its sampled mean (as
    ``smooth_quant_seq``, same bits), both NVFP4 along D, rows padded to a multiple of
    ``seq_pad``; K's sampled blocks are summed first (two small launches), then one launch
    quantizes every tile of Q and K. Returns (q_packed, q_scales, mean_q (Gq, nblk, D),
    k_packed, k_scales, mean_k (Gk, 1, D)). ``rotate`` (D 64/128): Q and K rotated first, the
    means are rotated means. ``search`` (D 64/128): the scale search, as ``smooth_quant_rows``."""
    return _smooth_quant_qk(q, k, seq_pad, rotate, False, False, search)[:6]


def smooth_quant_qk_key(q: torch.Tensor, k: torch.Tensor, seq_pad: int, rotate: bool = False,
                        balance: bool = False, search: bool = False) -> tuple[torch.Tensor, ...]:
    """``smooth_quant_qk`` (Gq > 0, D 64/128, Gq/Gk <= ``max_correction_heads``) plus qbar
    (Gq, 1, D): each q group's (rotated) sampled mean, from the same small launches, and ds_key
    (Gq, Skp) = qbar · (K's smoothed row as quantized) of its kv group (0 past Sk), from K's
    quantization. ``balance``: the channel balance (``reference.balance_exponents``,
    from the same sampled blocks of Q and K), Q and K and their means in the balanced space. Returns the 6
    tensors of ``smooth_quant_qk``, qbar, ds_key, the balance exponents (Gk, 1, D) or None, then K's
    quantization residual (Gk, Skp, D) float16 (``reference.quantize_residual``)."""
    return _smooth_quant_qk(q, k, seq_pad, rotate, True, balance, search)


def balance_samples(s: int) -> int:
    """Blocks the balance statistics read per group of Q or K: min(8, ceil(S/128))
    (``reference.sample_blocks``)."""
    from . import reference

    return len(reference.sample_blocks(s))


def qk_balance(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The channel balance exponents of q (Gq, Sq, D) and k (Gk, Sk, D) (D 64/128, Sq, Sk >= 1,
    Gq a multiple of Gk): (Gk, 1, D) float32, ``reference.balance_exponents``."""
    gq, s, d = q.shape
    gk, sk, _ = k.shape
    exps = torch.empty((gk, d), dtype=torch.float32, device=q.device)
    part = torch.empty((gq * balance_samples(s) + gk * balance_samples(sk), d), dtype=torch.float32, device=q.device)
    op("qk_balance")(q, k, part, exps)
    return exps.view(gk, 1, d)


def _smooth_quant_qk(q, k, seq_pad, rotate, key, balance, search):
    gq, sq, d = q.shape
    gk, sk, _ = k.shape
    dev = q.device
    q_packed, q_scales = _codes(q, gq, sq, d, seq_pad)
    k_packed, k_scales = _codes(q, gk, sk, d, seq_pad)
    nblk = -(-sq // 128)
    mean_q = torch.empty((gq, nblk, d), dtype=torch.float32, device=dev)
    mean_k = torch.empty((gk, 1, d), dtype=torch.float32, device=dev)
    partial = torch.empty((gk, -(-sk // 128), d), dtype=torch.float32, device=dev)
    if key:
        partial_q = torch.empty((gq, nblk, d), dtype=torch.float32, device=dev)
        qbar = torch.empty((gq, 1, d), dtype=torch.float32, device=dev)
        ds_key = torch.empty((gq, k_packed.shape[1]), dtype=torch.float32, device=dev)
        k_res = torch.empty((gk, k_packed.shape[1], d), dtype=torch.float16, device=dev)
    else:
        partial_q, qbar, ds_key, k_res = _none(dev, 0), _none(dev, 1), _none(dev, 2), _none(dev, 5)
    if balance:
        exps = torch.empty((gk, d), dtype=torch.float32, device=dev)
        bal_part = torch.empty((gq * balance_samples(sq) + gk * balance_samples(sk), d), dtype=torch.float32,
                               device=dev)
    else:
        exps, bal_part = _none(dev, 3), _none(dev, 4)
    op("smooth_quant_qk")(q, k, mean_q, q_packed, q_scales, mean_k, k_packed, k_scales, partial, rotate, search,
                          partial_q, qbar, ds_key, exps, bal_part, k_res)
    return (q_packed, q_scales, mean_q, k_packed, k_scales, mean_k, qbar, ds_key,
            exps.view(gk, 1, d) if balance else None, k_res if key else None)


def _codes(x: torch.Tensor, g: int, s: int, d: int, seq_pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    sp = -(-s // seq_pad) * seq_pad
    return (torch.empty((g, sp, d // 2), dtype=torch.uint8, device=x.device),
            torch.empty((g, sp, d // 16), dtype=torch.float8_e4m3fn, device=x.device))


def preprocess_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pad: int, per_block_mean: bool, rotate: bool,
                   balance: bool, search: bool) -> tuple[torch.Tensor, ...]:
    """Every output of ``sageattn3.preprocess`` from one op, which allocates them and makes all
    the launches (V first) in C++: q (B, Hq, Sq, D), k and v (B, Hkv, Sk, D) contiguous and
    16-byte aligned, D 64/128, Hq/Hkv <= ``max_correction_heads``. Returns (q_packed, q_scales,
    k_packed, k_scales, v_packed, v_scales, mean_q, mean_k, qbar, ds_key, balance, k_residual,
    v_exp) in the shapes of ``reference.Preprocessed`` (qbar and k_residual empty without
    per_block_mean, balance empty without it; v_exp int8 values as uint8).
    Outside autograd (as the ops that write into outputs allocated here): an op returning new
    tensors would give them a grad_fn when an input requires grad."""
    f = op("preprocess_qkv")
    if q.requires_grad or k.requires_grad or v.requires_grad:
        with torch.no_grad():
            return f(q, k, v, pad, per_block_mean, rotate, balance, search)
    return f(q, k, v, pad, per_block_mean, rotate, balance, search)


def mxfp8_smooth_quant(x: torch.Tensor, mean: torch.Tensor, balance: torch.Tensor | None, balance_sign: int,
                       sel: torch.Tensor | None, seq_pad: int, rotate: int = 0,
                       row_scale: float = 1.0, bf16: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 of x's smoothed rows for the FP8 Q·Kᵀ path (``reference.quantize_mxfp8_rows`` of x ·
    2^(balance_sign · balance) - mean, bit for bit): x (B, H, S, D) contiguous and aligned, mean
    (B, H, 1 or ceil(S/128), D) fp32, balance (B, Hkv, 1, D) exponents or None, sel (B, H) uint8
    or None (heads whose byte is 0 are skipped: their rows stay uninitialised); ``rotate`` (D 64/128):
    1 (or True): the balanced rows rotated before the mean (rotated already) is subtracted, as
    ``reference.preprocess(..., qk_rotation=True, qk_precision="fp8")`` makes them; 2: the mean
    (unrotated) rotated here too, and the rows then times ``row_scale`` (a power of two: 64/D for
    Q, 1 for K), as ``reference.fp8_rows`` makes them. Returns codes (B, H, Sp, D) float8_e4m3fn
    and scales (B, H, Sp, D/32) uint8, Sp = S rounded up to seq_pad. ``bf16`` (D 64): the same rows
    in bfloat16 instead (``reference.qk16_rows``, the 16-bit Q·Kᵀ), codes (B, H, Sp, D) bfloat16
    and scales empty."""
    b, h, s, d = x.shape
    sp = -(-s // seq_pad) * seq_pad
    codes = torch.empty((b, h, sp, 2 * d if bf16 else d), dtype=torch.uint8, device=x.device)
    scales = torch.empty((b, h, sp, 0 if bf16 else d // 32), dtype=torch.uint8, device=x.device)
    op("mxfp8_smooth_quant")(x, aligned(mean), _none(x.device, 8) if balance is None else aligned(balance),
                              int(balance_sign), _none(x.device, 9) if sel is None else sel.contiguous(), codes, scales,
                              int(rotate), float(row_scale))
    return codes.view(torch.bfloat16 if bf16 else torch.float8_e4m3fn), scales


def qk_rule_error(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pre, scale: float) -> torch.Tensor:
    """The "auto" rule's estimate (``reference.qk_fp4_error``) alone: ``qk_rule_select`` without P's
    estimate, its error output. q (B, Hq, Sq, D), k and v (B, Hkv, Sk, D) float16/bfloat16, D 64/128,
    and their ``Preprocessed`` (without K's per-block means; rotated or not), ``scale`` the softmax
    scale of the unrotated scores. Returns (B, Hq) float32 on q's device (no host synchronisation)."""
    return qk_rule_select(aligned(q), aligned(k), aligned(v), pre, scale, float("inf"), False, qk16_limit=-1.0)[0]


def qk_rule_select(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pre, scale: float, limit: float,
                   select_all: bool, pv_limit: float = -1.0, causal: bool = False,
                   qk16_limit: float | None = None) -> tuple[torch.Tensor, ...]:
    """``qk_rule_error`` and the selection in one op (no synchronisation): error (B, Hq) float32,
    sel_q (B, Hq) uint8 (bit 0: FP8 Q·Kᵀ, every head with ``select_all``, else error > limit, NaN keeping
    FP4), sel_k (B, Hkv) uint8 (1 where a q head has bit 0: ``reference.choose_qk_precision``); with
    ``pv_limit`` >= 0 the P·V estimate error_pv (B, Hq) (``reference.pv_p_error``, masked with ``causal``),
    bit 1 of sel_q above pv_limit and sel_v (B, Hkv) (1 where a q head has bit 1), else error_pv NaN, no
    bit 1, sel_v zeros; at D 128 (``qk16_limit``, None: ``reference.QK16_STAT_LIMIT``, below 0: off)
    qk16_stat (B, Hq) float32 (NaN where off), bit 2 of sel_q (``reference.choose_qk16``). q, k, v
    contiguous, 16-byte aligned; ``pre`` from the kernels (V's NVFP4 too)."""
    from . import reference
    d = q.shape[3]
    q16 = float(reference.QK16_STAT_LIMIT if qk16_limit is None else qk16_limit) if d == 128 else -1.0
    bal = _none(q.device, 10) if pre.balance is None else pre.balance
    v_exp = _none(q.device, 11) if pre.v_exp is None else pre.v_exp.view(torch.uint8)
    return op("qk_rule_select")(q, k, v, pre.q_packed, pre.q_scales, pre.k_packed, pre.k_scales, pre.v_packed,
                                pre.v_scales, v_exp, pre.mean_q, pre.mean_k, bal, *_rule_scale(pre, d, scale),
                                float(limit), bool(select_all), float(pv_limit), bool(causal), q16)


def _rule_scale(pre, d: int, scale: float) -> tuple[float, bool, bool]:
    """The rule ops' (sm_scale, rotate, floor): on rotated rows the scores are (D/64)·Q·Kᵀ, so the
    scale the op applies is divided by that (``reference.rotation_score_factor``); ``floor`` where
    ``pre`` has an option (``reference.rule_has_options``): the op also estimates the defaults'
    rows (options as floors; ``reference.qk_fp4_error``)."""
    from . import reference

    rot = bool(pre.qk_rotation)
    return float(scale) / (d / 64.0 if rot else 1.0), rot, reference.rule_has_options(pre)


def mxfp8_smooth_quant_qk(q: torch.Tensor, k: torch.Tensor, pre, sel_q: torch.Tensor, sel_k: torch.Tensor,
                          seq_pad: int) -> tuple[torch.Tensor, ...]:
    """Both MXFP8 operands of the per-head FP8 Q·Kᵀ (``mxfp8_smooth_quant`` of Q with sel_q, which
    skips the raw 16-bit heads, and of K with sel_k, balance signs -1 and +1) from one op that
    allocates them: (q8, q8_scales, k8, k8_scales), codes uint8 (B, H, Sp, D), scales uint8
    (B, H, Sp, D/32); at D 64 the 16-bit Q·Kᵀ's bf16 rows (``reference.qk16_rows``) as bytes
    (B, H, Sp, 2D), scales (B, H, Sp, 0); rotated as ``pre`` is, or here with Q's rows times 64/D
    (``reference.fp8_rows``). q and k contiguous and 16-byte aligned, ``pre`` from the kernels."""
    bal = _none(q.device, 8) if pre.balance is None else pre.balance
    return op("mxfp8_smooth_quant_qk")(q, k, pre.mean_q, pre.mean_k, bal, sel_q, sel_k, int(seq_pad),
                                       1 if pre.qk_rotation else 2)


def _attention_call_fake(q, k, v, *args):  # sageattn3._call: its output, (B, Hq, Sq, D) in q's dtype
    torch._check(q.shape[3] in (64, 128), lambda: f"sageattn3: attention_call needs head dim 64 or 128, got {q.shape}")
    return q.new_empty(q.shape)


def _preprocess_qkv_fake(q, k, v, pad, per_block_mean, rotate, balance, search):
    b, hq, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    torch._check(d in (64, 128), lambda: f"sageattn3: preprocess_qkv needs head dim 64 or 128, got {d}")
    torch._check(per_block_mean or not balance, lambda: "sageattn3: the channel balance needs per_block_mean")
    torch._check(pad > 0 and pad % 16 == 0, lambda: f"sageattn3: pad must be a positive multiple of 16, got {pad}")
    sqp, skp = -(-sq // pad) * pad, -(-sk // pad) * pad
    nm = -(-sq // 128) if per_block_mean else 1

    def new(shape, dtype):
        return q.new_empty(shape, dtype=dtype)

    u8, e4, f32 = torch.uint8, torch.float8_e4m3fn, torch.float32
    return (new((b, hq, sqp, d // 2), u8), new((b, hq, sqp, d // 16), e4),
            new((b, hk, skp, d // 2), u8), new((b, hk, skp, d // 16), e4),
            new((b, hk, d, skp // 2), u8), new((b, hk, d, skp // 16), e4),
            new((b, hq, nm, d), f32), new((b, hk, 1, d), f32),
            new((b if per_block_mean else 0, hq, 1, d), f32), new((b, hq, skp), f32),
            new((b if balance else 0, hk, 1, d), f32), new((b if per_block_mean else 0, hk, skp, d), torch.float16),
            new((b, hk, -(-skp // 128), d // 32), u8))


def delta_s(k: torch.Tensor, mean_k: torch.Tensor, mean_q: torch.Tensor, seq_pad: int) -> torch.Tensor:
    """k (B, Hkv, Sk, D), mean_k (B, Hkv, 1, D), mean_q (B, Hq, nblk, D) -> (B, Hq, nblk, Sk_p)."""
    b, hq, nblk, _ = mean_q.shape
    sk = k.shape[2]
    sp = -(-sk // seq_pad) * seq_pad
    out = torch.empty((b, hq, nblk, sp), dtype=torch.float32, device=k.device)
    op("delta_s")(k, mean_k, mean_q, out)
    return out


# ---------------------------------------------------------------------------------------------
# Fake (meta) implementations, for torch.compile and FakeTensor tracing
# ---------------------------------------------------------------------------------------------

# The ops the compiled library registers (csrc/torch/ops.h, SAGEATTN3_OPS). Each writes into
# output tensors its caller allocated and returns nothing ("-> ()"), so its fake has nothing
# to compute: the outputs already exist, with their shapes. A new op must be added here after
# checking that it, too, only writes into its outputs (tests compare this tuple with the C++
# table and with the loaded library).
OUTPUT_WRITING_OPS = (
    "quant_fp4_rows", "quant_fp4_cols", "quant_mxfp8_cols", "smooth_quant_rows", "smooth_quant_seq",
    "smooth_quant_qk", "qk_balance", "delta_s", "smooth_quant_k_delta", "blockscaled_fp4_attn",
    "blockscaled_attn_qk8", "blockscaled_attn_pv8", "blockscaled_attn_mixed", "mxfp8_smooth_quant", "fp4_mma_probe",
)
# Ops of the library that allocate and return their outputs, with the fakes that give those
# outputs' shapes (kept next to the op's wrapper above).
def _qk_rule_select_fake(q, k, v, q_packed, q_scales, k_packed, k_scales, v_packed, v_scales, v_exp, mean_q, mean_k,
                         balance, sm_scale, rotate, floor, limit, select_all, pv_limit, causal=False, qk16_limit=-1.0):
    b, hq, hk = q.shape[0], q.shape[1], k.shape[1]
    f32, u8 = torch.float32, torch.uint8
    return (q.new_empty((b, hq), dtype=f32), q.new_empty((b, hq), dtype=u8), q.new_empty((b, hk), dtype=u8),
            q.new_empty((b, hq), dtype=f32), q.new_empty((b, hk), dtype=u8), q.new_empty((b, hq), dtype=f32))


def _mxfp8_smooth_quant_qk_fake(q, k, mean_q, mean_k, balance, sel_q, sel_k, seq_pad, rotate):
    (b, hq, sq, d), hk, sk = q.shape, k.shape[1], k.shape[2]
    sqp, skp = -(-sq // seq_pad) * seq_pad, -(-sk // seq_pad) * seq_pad
    u8 = torch.uint8
    row, sf = (2 * d, 0) if d == 64 else (d, d // 32)  # D 64: bf16 rows, no scales (the 16-bit Q·Kᵀ)
    return (q.new_empty((b, hq, sqp, row), dtype=u8), q.new_empty((b, hq, sqp, sf), dtype=u8),
            q.new_empty((b, hk, skp, row), dtype=u8), q.new_empty((b, hk, skp, sf), dtype=u8))


ALLOCATING_OPS = {"preprocess_qkv": _preprocess_qkv_fake, "qk_rule_select": _qk_rule_select_fake,
                  "mxfp8_smooth_quant_qk": _mxfp8_smooth_quant_qk_fake, "attention_call": _attention_call_fake}
# Ops defined in Python (sageattn3.api), with their own fakes.
PYTHON_OPS = ("attention",)

_faked: set[str] = set()


def library_ops() -> list[str]:
    """The names of every ``torch.ops.sageattn3.*`` op registered in this process."""
    prefix = "sageattn3::"
    return sorted({n[len(prefix):].split(".")[0] for n in torch._C._dispatch_get_all_op_names() if n.startswith(prefix)})


def _writes_outputs_only(*args, **kwargs) -> None:
    return None


def register_fakes() -> list[str]:
    """Give every op of the loaded library its fake (once): nothing for the output-writing ops,
    the outputs' shapes for ALLOCATING_OPS; returns the ops of the library that have none (an op
    this module does not know)."""
    missing = []
    for name in library_ops():
        if name in PYTHON_OPS or name in _faked:
            continue
        if name not in OUTPUT_WRITING_OPS and name not in ALLOCATING_OPS:
            missing.append(name)
            continue
        torch.library.register_fake(f"sageattn3::{name}", ALLOCATING_OPS.get(name, _writes_outputs_only))
        _faked.add(name)
        op(name)  # filled now: the wrappers only read the cache (also while dynamo traces them)
    return missing
