"""The public API: dispatch between the CUDA kernels, the exact reference and torch SDPA.
The validation (in Python, with messages naming the argument) is in ``_validate``, the
quantization and preprocessing entry points in ``_preprocess_api`` and the per-head Q·Kᵀ
precision in ``_qk_choice``; their public names are re-exported here.

Per call, the eager path does little Python: one pass of checks, one dict lookup for the path
a (device, head dim) takes (decided, warned about and self-checked on the first call), then the
kernels. Under ``torch.compile`` the path is decided at trace time (``_compile_path``) and the FP4
path is one custom op, ``torch.ops.sageattn3.attention`` (self-check and fallback run inside
it, at run time), so ``sageattn3_blackwell`` compiles with ``fullgraph=True`` without breaks."""

from __future__ import annotations

import dataclasses

import warnings
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from sageattn3 import _attn, _call, _kernels, _pv8, _selfcheck, reference
from sageattn3._preprocess_api import (  # noqa: F401  (public names re-exported here)
    _delta_key_torch,
    _kernels_serve,
    _preprocess_kernels,
    _use_kernels,
    preprocess,
    scale_and_quant_fp4,
    scale_and_quant_fp4_permute,
    scale_and_quant_fp4_transpose,
)
from sageattn3._qk_choice import QkChoice, _qk_error, _qk_selection, qk_choice  # noqa: F401
from sageattn3._validate import _ATTN_DTYPES, _QUANT_DTYPES, _check_qkv, _check_tensor, _flags, _search  # noqa: F401
from sageattn3.reference import Preprocessed  # noqa: F401

_warned: set[str] = set()


# ---------------------------------------------------------------------------------------------
# Backend selection
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionPath:
    """The path a (device, head dim) takes: the FP4 kernel, or torch SDPA and why.

    ``str()`` is what ``backend()`` reports: "fp4-sm120" / "fp4-sm121" (the FP4 kernel),
    "fp4-model-sm90" (the MMA-model test flavour, forced with SAGEATTN3_FORCE_FP4=1), or
    "sdpa: <reason>"."""

    kind: Literal["fp4", "sdpa"]
    reason: str = ""  # sdpa: why not the FP4 kernel
    arch: str = ""  # fp4: the GPU's "sm120", "sm121" (or "sm90" with the MMA model)
    model: bool = False  # fp4: the MMA-model test flavour runs the FP4 MMA as a software model

    @classmethod
    def fp4(cls, cc: tuple[int, int], model: bool = False) -> AttentionPath:
        return cls("fp4", arch=f"sm{cc[0]}{cc[1]}", model=model)

    @classmethod
    def sdpa(cls, reason: str) -> AttentionPath:
        return cls("sdpa", reason=reason)

    @property
    def is_fp4(self) -> bool:
        return self.kind == "fp4"

    def __str__(self) -> str:
        if self.kind == "sdpa":
            return f"sdpa: {self.reason}"
        return f"fp4-model-{self.arch}" if self.model else f"fp4-{self.arch}"


def _attention_path(device: torch.device, head_dim: int | None = None) -> AttentionPath:
    """The path ``sageattn3_blackwell`` takes for ``device`` and ``head_dim`` (None: any
    supported head dim)."""
    if device.type != "cuda":
        return AttentionPath.sdpa("CPU tensors" if device.type == "cpu" else f"{device.type} tensors")
    cc = _kernels.device_cc(device)
    arch = f"sm_{cc[0]}{cc[1]}"
    forced = False
    if cc not in _kernels.FP4_MMA_CCS:
        why = f"{arch} has no FP4 MMA (the FP4 path needs sm_120/sm_121)"
        if not _kernels.force_fp4_requested():
            return AttentionPath.sdpa(why)
        if not _kernels.mma_model_build():
            return AttentionPath.sdpa(f"{why}; {_kernels.FORCE_FP4_ENV}=1 is ignored: it only applies to the "
                                      "MMA-model test flavour, and this wheel is a normal build")
        forced = True
    why = _kernels.kernels_run_on(device)
    if why is not None:
        return AttentionPath.sdpa(why)
    if not _kernels.has_attention_kernel():
        return AttentionPath.sdpa(f"the FP4 attention kernel is not in this build yet ({arch} quantization kernels "
                                  "available)")
    if head_dim is not None and head_dim not in _kernels.ATTN_HEAD_DIMS:
        return AttentionPath.sdpa(f"head_dim {head_dim} is not supported by the FP4 kernel "
                                  f"({'/'.join(map(str, _kernels.ATTN_HEAD_DIMS))})")
    failed = _selfcheck.failure(device)
    if failed is not None:
        return AttentionPath.sdpa(_selfcheck.fallback_reason(failed))
    return AttentionPath.fp4(cc, model=forced)


def _explain(path: AttentionPath, device: torch.device) -> str:
    """What backend() adds to an FP4 path: which flavour runs, and the self-check's state."""
    notes = []
    if path.model:
        notes.append(f"{_kernels.FORCE_FP4_ENV}=1 with the MMA-model test flavour: the FP4 MMA runs as a software "
                     "model (for testing the wiring; not fast, not for production)")
    elif _kernels.mma_model_build():
        notes.append("MMA-model test flavour: the FP4 MMA runs as a software model")
    notes.append(_selfcheck.describe(device))
    return f"{path} ({'; '.join(notes)})"


def _device(device) -> torch.device:
    """``device`` as a torch.device with its index (default: the current CUDA device, or CPU
    without CUDA)."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def backend(device=None, head_dim: int | None = None) -> str:
    """Which path ``sageattn3_blackwell`` takes on ``device`` (default: the current CUDA
    device, or CPU without CUDA) and why: "fp4-sm120 (self-check ...)", or "sdpa: <reason>".
    The MMA-model test flavour with SAGEATTN3_FORCE_FP4=1 on a GPU without FP4 MMA (an H100):
    "fp4-model-sm90 (...)"."""
    device = _device(device)
    path = _attention_path(device, head_dim)
    return _explain(path, device) if path.is_fp4 else str(path)


def is_available(device=None) -> bool:
    """True when ``sageattn3_blackwell`` runs the FP4 kernel on ``device``."""
    return _attention_path(_device(device), None).is_fp4


def _warn_once(reason: str, stacklevel: int = 3) -> None:
    if reason in _warned:
        return
    _warned.add(reason)
    warnings.warn(f"sageattn3: falling back to torch scaled_dot_product_attention ({reason})", RuntimeWarning,
                  stacklevel=stacklevel)


# (device, head_dim) -> None: the FP4 path, self-checked (or the check skipped); or the reason
# for SDPA (warned about once per process). Filled by _decide on the first call; emptied by
# _selfcheck.reset() (tests).
_paths: dict[tuple[torch.device, int], str | None] = {}
_selfcheck.on_reset(_paths.clear)
_UNDECIDED = object()  # _paths has no entry for the key yet


def _decide(device: torch.device, head_dim: int) -> str | None:
    """The first call's decision for (device, head_dim): the path, its one warning and the
    self-check. Remembered unless it could not be final (the self-check postponed because the
    stream is being captured into a CUDA graph)."""
    path = _attention_path(device, head_dim)
    if not path.is_fp4:
        _paths[(device, head_dim)] = path.reason
        return path.reason
    res = _selfcheck.ensure(device, _fp4_attention)
    if res is not None and not res.ok:
        reason = _selfcheck.fallback_reason(res)
        _warned.add(reason)  # the self-check's own loud warning stands for it
        _paths[(device, head_dim)] = reason
        return reason
    if res is not None or _selfcheck.skipped():
        _paths[(device, head_dim)] = None
    return None


# ---------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------


def _sdpa(q, k, v, is_causal: bool) -> torch.Tensor:
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)


def sageattn3_blackwell(q, k, v, attn_mask=None, is_causal: bool = False, per_block_mean: bool = True,
                        qk_rotation: bool = reference.QK_ROTATION_DEFAULT,
                        qk_balance: bool = reference.QK_BALANCE_DEFAULT, qk_scale_search: bool | None = None,
                        qk_precision: str = reference.QK_PRECISION_DEFAULT, return_qk_choice: bool = False,
                        pv_precision: str = reference.PV_PRECISION_DEFAULT):
    """FP4 attention. q (B, Hq, Sq, D), k and v (B, Hkv, Sk, D), float16 or bfloat16, one
    device; Hq a multiple of Hkv (GQA/MQA); any sequence lengths (Sk >= 1). Returns
    (B, Hq, Sq, D) in q's dtype; the inputs are never modified. ``is_causal``: key j is visible
    to query i iff j <= i (top-left aligned, as torch SDPA). ``attn_mask`` is not supported.

    On sm_120/sm_121 with this build's FP4 kernel and D 64/128: preprocessing (smoothing +
    NVFP4, ``preprocess``) and the FP4 attention kernel, i.e. the SageAttention3 algorithm of
    ``sageattn3.reference.sageattn3``. The first FP4 call on a device runs a tiny known-answer
    check first (``sageattn3._selfcheck``; SAGEATTN3_SKIP_SELFCHECK=1 skips it); if it fails,
    one loud warning and SDPA on that device from then on. Elsewhere (other GPUs, CPU tensors,
    unsupported head dims, kernel not built): torch SDPA, with one warning per process and
    reason. ``backend()`` says which path a device takes and why; the path of a (device, head
    dim) is decided on its first call. ``qk_rotation=True``: rotate Q and K by a fixed
    randomized Hadamard transform before quantizing them (``sageattn3.reference.rotate``;
    attention is unchanged, outlier channels are spread before the 16-channel FP4 blocks form):
    more accurate with Q outlier channels (at D 128), worse where only K has them or on
    near-one-hot rows unless the balance is on too (README, "Accuracy"), and it makes the preprocessing
    slower (about +45% on an H100), so it is off by default. ``qk_balance``: the Q/K channel
    balance (``sageattn3.reference.balance_exponents``; D 64/128): channels much larger in Q than
    in K (relative to the other channels) are scaled down in Q and up in K by powers of two, and
    the other way round (attention is unchanged), which moves FP4 error away from outlier
    channels (README, "Accuracy"); it makes the preprocessing about 7% slower on an H100, so it
    is off by default. Both together: balanced first, then rotated (the most accurate with Q or
    K outlier channels). ``qk_scale_search=True``: Q and K quantized with
    the NVFP4 scale search (``sageattn3.reference.quantize_rows``; D 64/128), more accurate
    everywhere but the preprocessing is much slower on an H100 (README, "Accuracy"); None (the
    default) takes ``sageattn3.reference.QK_SCALE_SEARCH`` (False unless set), and is on with
    ``qk_rotation`` (``sageattn3.reference.scale_search_on``: the rotation alone rounds a little
    below the defaults on heads that need no help; pass False to turn it off, at that price: up to
    0.0017 cos-sim below the defaults on the documented cases).
    ``qk_precision``: "auto" (the default) decides per head, on the device, whether Q·Kᵀ runs
    with FP4 operands or the precise rung: MXFP8 at head dim 128, bf16 rows at head dim 64 (the
    16-bit Q·Kᵀ; "fp8" below means that rung too) (``sageattn3.reference.qk_fp4_error`` and ``AUTO_ERROR_LIMIT``: heads
    whose estimated output error from FP4 Q·Kᵀ is large, e.g. RoPE'd biased keys, near-one-hot rows,
    outlier channels; docs/accuracy-auto.md); where no head needs it the output is FP4's bit for
    bit. On 2 to 127 query rows (``AUTO_SHORT_QUERY_ROWS``) every head takes the precise rung: the
    estimate misses heads there (``sageattn3.reference.rule_limit``). "fp4": every head FP4 (the rule does not run); "fp8": every head FP8 (D 64/128). FP8
    heads always multiply rotated rows (rotated for them alone where ``qk_rotation`` is off:
    outliers Q and K share then spread over every block); with ``qk_rotation`` the rule also
    estimates on the rotated rows. At head dim 128, an FP8 head whose MXFP8 logit error the rule
    measures as large (``sageattn3.reference.qk16_stat`` above ``QK16_STAT_LIMIT``: massive outliers
    Q and K share) multiplies its raw fp16/bf16 rows instead (``QkChoice.qk16``).
    ``pv_precision``: "auto" (the default) P and V in MXFP8 for the heads whose P or V the rule finds
    too coarse for NVFP4 (``sageattn3.reference.pv_p_error`` above ``PV_ERROR_LIMIT``: peaky rows
    whose output comes from keys far below the row max, e.g. large logits in fp16; or keys that take
    most of a row's P with a V small beside their 16-key block's, e.g. attention sinks with a small
    V), NVFP4 P·V elsewhere;
    the rule runs with the Q·Kᵀ rule ("auto"/"fp8"; with qk_precision="fp4" every head keeps NVFP4
    P·V). "fp4": every head NVFP4; "fp8": every head MXFP8 (D 64/128, as every kernel path: other
    head dims take SDPA; ``sageattn3.reference.sageattn3(..., pv_precision="fp8")``), with FP4 or
    FP8 Q·Kᵀ per ``qk_precision``; it needs the delta_s workspace with per-block Q means
    (ValueError where ``SAGEATTN3_DELTA_S_WORKSPACE_MIB`` cannot hold one row; "auto" then keeps
    NVFP4). ``return_qk_choice=True`` (outside torch.compile) returns ``(out, QkChoice)``: which
    heads ran FP8 Q·Kᵀ and P·V, and the rule's estimates (``qk_choice``).

    Under ``torch.compile`` (``fullgraph=True`` works): the path is decided when tracing; the
    FP4 path is the custom op ``torch.ops.sageattn3.attention`` (not differentiable, like the
    kernel itself), the SDPA path stays in the graph."""
    if attn_mask is not None:
        raise NotImplementedError(
            "sageattn3_blackwell does not support attn_mask (it is never silently ignored); use "
            "is_causal=True for causal masking or torch.nn.functional.scaled_dot_product_attention"
        )
    flags = _flags(is_causal=is_causal, per_block_mean=per_block_mean, qk_rotation=qk_rotation, qk_balance=qk_balance)
    search = _search(qk_scale_search, flags[2])
    precision = reference.qk_precision_arg(qk_precision)
    pv = reference.pv_precision_arg(pv_precision)
    if reference.flag(return_qk_choice, "return_qk_choice"):
        if torch.compiler.is_compiling():
            raise NotImplementedError("return_qk_choice=True is a debugging aid of eager calls; under torch.compile "
                                      "call sageattn3.qk_choice(q, k, v) outside the compiled region")
        choice: list[QkChoice] = []
        out = _eager_call(q, k, v, *flags, search, precision, choice, pv_precision=pv)
        return out, (choice[0] if choice else QkChoice.fp4_path(q, precision, "the FP4 kernel did not run (SDPA)"))
    if torch.compiler.is_compiling():
        return _traced(q, k, v, *flags, search, precision, pv)
    return _eager_call(q, k, v, *flags, search, precision, pv_precision=pv)

def _eager_call(q, k, v, is_causal: bool, per_block_mean: bool,
                qk_rotation: bool = reference.QK_ROTATION_DEFAULT,
                qk_balance: bool = reference.QK_BALANCE_DEFAULT, qk_scale_search: bool = False,
                qk_precision: str = reference.QK_PRECISION_DEFAULT, choice: list | None = None, *,
                pv_precision: str = reference.PV_PRECISION_DEFAULT) -> torch.Tensor:
    """What ``sageattn3_blackwell`` does outside torch.compile (the custom op's body)."""
    _check_qkv(q, k, v)
    if q.numel() == 0:
        return q.new_empty(q.shape)
    key = (q.device, q.shape[3])
    why = _paths.get(key, _UNDECIDED)
    if why is _UNDECIDED:
        why = _decide(*key)
    if why is None:
        if pv_precision == "fp8" or (pv_precision == "auto" and qk_precision != "fp4" and _pv8_built()):
            if not _selfcheck.pv8_usable(q.device, _fp4_attention):
                pv_precision = "fp4"  # its self-check failed on this device (warned once, loudly)
        return _fp4_attention(q, k, v, is_causal, per_block_mean, qk_rotation=qk_rotation, qk_balance=qk_balance,
                              qk_scale_search=qk_scale_search, qk_precision=qk_precision, choice=choice,
                              pv_precision=pv_precision)
    if why not in _warned:
        _warn_once(why, stacklevel=4)
    return _sdpa(q, k, v, is_causal)


@torch.library.custom_op("sageattn3::attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                  per_block_mean: bool, qk_rotation: bool, qk_balance: bool, qk_scale_search: bool,
                  qk_precision: str, pv_precision: str = "auto") -> torch.Tensor:
    """``sageattn3_blackwell`` as one op for compiled graphs: the self-check, the fallback and
    the kernels run here, at run time. Contiguous (B, Hq, Sq, D) output, as its fake says."""
    return _eager_call(q, k, v, is_causal, per_block_mean, qk_rotation, qk_balance, qk_scale_search,
                       qk_precision, pv_precision=pv_precision).contiguous()


@_attention_op.register_fake
def _attention_op_fake(q, k, v, is_causal, per_block_mean, qk_rotation, qk_balance, qk_scale_search, qk_precision,
                       pv_precision="auto"):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _compile_path(device: torch.device) -> bool:
    """Whether the FP4 kernel serves ``device`` (head dims 64/128). Dynamo runs this while
    tracing and keeps the result as a constant (``torch._dynamo.assume_constant_result``), so
    the device queries never enter the graph; the one warning for the SDPA fallback is given
    here, at compile time. A failed self-check still falls back, inside the op."""
    path = _attention_path(device, None)
    if not path.is_fp4:
        _warn_once(path.reason, stacklevel=2)
        return False
    return True


# What torch._dynamo.assume_constant_result does (it sets this attribute and nothing else),
# without importing torch._dynamo when sageattn3 is imported (seconds on a small machine).
_compile_path._dynamo_marked_constant = True


def _traced(q, k, v, is_causal: bool, per_block_mean: bool, qk_rotation: bool, qk_balance: bool,
            qk_scale_search: bool, qk_precision: str = reference.QK_PRECISION_DEFAULT,
            pv_precision: str = reference.PV_PRECISION_DEFAULT) -> torch.Tensor:
    """The compiled form of ``sageattn3_blackwell``: only what dynamo traces without breaks."""
    _check_qkv(q, k, v)
    if q.shape[0] == 0 or q.shape[1] == 0 or q.shape[2] == 0:
        return q.new_empty(q.shape)
    if q.shape[3] in _kernels.ATTN_HEAD_DIMS and _compile_path(q.device):
        return torch.ops.sageattn3.attention(q, k, v, is_causal, per_block_mean, qk_rotation, qk_balance,
                                             qk_scale_search, qk_precision, pv_precision)
    return _sdpa(q, k, v, is_causal)


def _checked(device: torch.device) -> bool:
    """Runs the self-check on the first FP4 call on ``device``; False when it failed (it then
    warned, once: that warning stands for the fallback's own)."""
    res = _selfcheck.ensure(device, _fp4_attention)
    if res is None or res.ok:
        return True
    _warned.add(_selfcheck.fallback_reason(res))
    return False


def _fp4_attention(q, k, v, is_causal: bool, per_block_mean: bool, sm_scale: float | None = None,
                   qk_rotation: bool = reference.QK_ROTATION_DEFAULT,
                   qk_balance: bool = reference.QK_BALANCE_DEFAULT, qk_scale_search: bool = False,
                   qk_precision: str = "fp4", choice: list | None = None,
                   pv_precision: str = reference.PV_PRECISION_DEFAULT, pv_limit: float | None = None) -> torch.Tensor:
    """The FP4 path on validated, non-empty q, k, v: preprocess (new tensors; the inputs are
    only read), then the attention kernel; output (B, Hq, Sq, D) in q's dtype. Every
    allocation names q's device and every op sets its device itself: no device switch here.
    ``qk_precision`` "auto"/"fp8": the rule (torch ops on the device, no synchronisation), the
    MXFP8 operands of the chosen heads and the attention with the per-head precision; "fp4" (and
    where FP8 cannot run, with "auto"): exactly the FP4 path. ``choice``: a list the QkChoice is
    appended to (the debug return). q, k, v are made contiguous and aligned once, here, for every
    op; the delta_s workspace's limit (``SAGEATTN3_DELTA_S_WORKSPACE_MIB``) is read once.
    Where ``sageattn3._call`` serves the call (no ``choice``), one op makes every launch below.
    ``pv_precision`` "fp8": V in MXFP8 (``_pv8.quant_mxfp8_cols``) and the FP8 P·V kernels for
    every head; "auto" (where the Q·Kᵀ rule runs and the build has them): for the heads whose P's
    estimate exceeds ``pv_limit`` (None: ``reference.PV_ERROR_LIMIT``; the self-check sets its own)."""
    q, k, v = _kernels.aligned_eager(q), _kernels.aligned_eager(k), _kernels.aligned_eager(v)
    pv_rule = pv_precision == "auto" and _pv8_built()
    pv_limit = reference.PV_ERROR_LIMIT if pv_limit is None else pv_limit
    if choice is None and _call.serves(q, k):  # the same launches from one op
        return _call.call(q, k, v, is_causal, per_block_mean, sm_scale, qk_rotation, qk_balance, qk_scale_search,
                          qk_precision, pv_precision, pv_rule, pv_limit)
    pre = _preprocess_kernels(q, k, v, per_block_mean, _attn.SEQ_PAD, qk_rotation, qk_balance, qk_scale_search,
                              inputs_aligned=True)
    limit = _attn.delta_s_workspace_limit() if pre.mean_q.shape[2] > 1 else 0  # unused with one Q mean
    picked = _qk_selection(q, k, v, pre, qk_precision, sm_scale, limit, pv_limit=pv_limit if pv_rule else -1.0,
                           is_causal=is_causal)
    kw = {"is_causal": is_causal, "sm_scale": sm_scale, "out_dtype": q.dtype, "workspace_limit": limit}
    if isinstance(picked, str):  # every head FP4 Q·Kᵀ, and P·V as pv_precision says ("auto": FP4)
        if choice is not None:
            choice.append(_all_pv8(QkChoice.fp4_path(q, qk_precision, picked), pv_precision))
        if pv_precision == "fp8":
            return _pv8.attention_pv8(pre, *_pv8.quant_mxfp8_cols(v, _attn.SEQ_PAD), **kw)
        return _attn.attention_from_preprocessed(pre, trusted=True, **kw)
    if choice is not None:
        picked_choice = picked.choice(qk_precision, pv_rule, reference.rule_limit(q.shape[2]))
        choice.append(_all_pv8(picked_choice, pv_precision))
    q8, q8s, k8, k8s = _kernels.mxfp8_smooth_quant_qk(q, k, pre, picked.sel_q, picked.sel_k, _attn.SEQ_PAD)
    qk8 = {"head_sel": picked.sel_q, "q8": q8, "q8_scales": q8s, "k8": k8, "k8_scales": k8s,
           "raw": (q, k) if reference.raw16_fits(q, k) else None}  # bit 2's raw rows
    if pv_precision == "fp8":
        return _pv8.attention_pv8(pre, *_pv8.quant_mxfp8_cols(v, _attn.SEQ_PAD), **qk8, **kw)
    if pv_rule:  # V's MXFP8 for the kv heads whose q heads the rule gave FP8 P·V (sel_v), then one launch per byte
        v8, v8s = _pv8.quant_mxfp8_cols(v, _attn.SEQ_PAD, sel=picked.sel_v)
        return _pv8.attention_pv8(pre, v8, v8s, **qk8, by_head=True, **kw)
    return _attn.attention_qk8(pre, picked.sel_q, q8, q8s, k8, k8s, raw=qk8["raw"], **kw)


def _all_pv8(choice: QkChoice, pv_precision: str) -> QkChoice:
    """The debug return with pv_precision="fp8": every head's P·V in FP8."""
    if pv_precision != "fp8":
        return choice
    return dataclasses.replace(choice, pv_fp8=torch.ones_like(choice.fp8))


def _pv8_built() -> bool:
    """Whether this build has the FP8 P·V kernels (the ops of the per-head and every-head paths)."""
    ops = torch.ops.sageattn3
    return hasattr(ops, "blockscaled_attn_mixed") and hasattr(ops, "blockscaled_attn_pv8")


def blockscaled_fp4_attn(q, k, v, is_causal: bool = False, per_block_mean: bool = True, sm_scale: float | None = None,
                         qk_rotation: bool = reference.QK_ROTATION_DEFAULT,
                         qk_balance: bool = reference.QK_BALANCE_DEFAULT, qk_scale_search: bool | None = None,
                         qk_precision: str = reference.QK_PRECISION_DEFAULT,
                         pv_precision: str = reference.PV_PRECISION_DEFAULT):
    """The FP4 block-scaled attention kernel itself, without fallback: q, k, v as for
    ``sageattn3_blackwell`` (float16/bfloat16, D 64 or 128, GQA/MQA, any lengths); ``sm_scale``
    defaults to 1/sqrt(D); ``qk_rotation``, ``qk_balance``, ``qk_scale_search``, ``qk_precision``
    and ``pv_precision`` as for ``sageattn3_blackwell``. Raises
    NotImplementedError when this build has no attention kernel, RuntimeError when the kernel
    cannot run on q's device (the message says why, as ``backend()`` does) or when the device
    failed the self-check (that of the FP8 P·V kernels too, with ``pv_precision="fp8"``)."""
    pv = reference.pv_precision_arg(pv_precision)
    if not _kernels.has_attention_kernel():
        raise NotImplementedError(
            "sageattn3.blockscaled_fp4_attn: the FP4 attention kernel is not implemented in this build "
            f"({_kernels.NOT_LOADED_REASON or 'no blockscaled_fp4_attn op'}); use sageattn3_blackwell "
            "(falls back to SDPA) or sageattn3.reference.sageattn3"
        )
    _check_qkv(q, k, v)
    if pv == "fp8" and not _pv8_built():
        raise NotImplementedError("sageattn3.blockscaled_fp4_attn: pv_precision='fp8' needs a build with the FP8 P·V "
                                  "kernel (no blockscaled_attn_pv8 op)")
    path = _attention_path(q.device, q.shape[3])
    if not path.is_fp4:
        raise RuntimeError(f"sageattn3.blockscaled_fp4_attn cannot run here: {path.reason}")
    if q.shape[2] == 0 or q.shape[0] == 0 or q.shape[1] == 0:
        return q.new_empty(q.shape)
    if not _checked(q.device):
        raise RuntimeError(f"sageattn3.blockscaled_fp4_attn: {_selfcheck.fallback_reason(_selfcheck.failure(q.device))}")
    if pv == "auto" and qk_precision != "fp4" and _pv8_built() and not _selfcheck.pv8_usable(q.device, _fp4_attention):
        pv = "fp4"  # the FP8 P·V self-check failed: the rule keeps NVFP4 P·V (warned once, loudly)
    if pv == "fp8" and not _selfcheck.pv8_usable(q.device, _fp4_attention):
        raise RuntimeError("sageattn3.blockscaled_fp4_attn: the FP8 P·V self-check failed on this device: "
                           f"{_selfcheck.ensure(q.device, _fp4_attention, 'pv8').summary()}; use pv_precision='fp4'")
    causal, pbm, rot, bal = _flags(is_causal=is_causal, per_block_mean=per_block_mean, qk_rotation=qk_rotation,
                                   qk_balance=qk_balance)
    return _fp4_attention(q, k, v, causal, pbm, sm_scale, qk_rotation=rot, qk_balance=bal,
                          qk_scale_search=_search(qk_scale_search, rot),
                          qk_precision=reference.qk_precision_arg(qk_precision), pv_precision=pv)

