"""The public API: validation (here, in Python, with messages naming the argument), dispatch
between the CUDA kernels, the exact reference and torch SDPA.

Per call, the eager path does little Python: one pass of checks, one dict lookup for the path
a (device, head dim) takes (decided, warned about and self-checked on the first call), then the
kernels. Under ``torch.compile`` the path is decided at trace time (``_compile_path``) and the FP4
path is one custom op, ``torch.ops.sageattn3.attention`` (self-check and fallback run inside
it, at run time), so ``sageattn3_blackwell`` compiles with ``fullgraph=True`` without breaks."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from sageattn3 import _attn, _kernels, _selfcheck, reference
from sageattn3.reference import Preprocessed

_QUANT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_ATTN_DTYPES = (torch.float16, torch.bfloat16)
_warned: set[str] = set()


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


def _check_tensor(x, name: str, dtypes, min_dim: int = 1) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must be one of {names}, got {str(x.dtype).replace('torch.', '')}")
    if x.dim() < min_dim:
        raise ValueError(f"{name} must have at least {min_dim} dims, got shape {tuple(x.shape)}")


def _check_qkv(q, k, v) -> None:
    if isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor):
        qs, ks = q.shape, k.shape
        if (q.dtype in _ATTN_DTYPES and k.dtype == q.dtype and v.dtype == q.dtype and len(qs) == 4
                and len(ks) == 4 and v.shape == ks and ks[0] == qs[0] and ks[3] == qs[3] and qs[3] != 0
                and ks[1] != 0 and ks[2] != 0 and qs[1] % ks[1] == 0 and k.device == q.device
                and v.device == q.device):
            return  # the common case in one expression; anything else gets its message below
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(t, name, _ATTN_DTYPES)
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, heads, seq, head_dim), got shape {tuple(t.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}: all must match")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}: all must be on one device")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k has batch {k.shape[0]} but q has batch {q.shape[0]}")
    if k.shape[3] != q.shape[3]:
        raise ValueError(f"k has head_dim {k.shape[3]} but q has head_dim {q.shape[3]}")
    if q.shape[3] == 0:
        raise ValueError("q has head_dim 0")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"q heads ({q.shape[1]}) must be a positive multiple of k/v heads ({k.shape[1]}) (GQA/MQA)"
        )
    if k.shape[2] == 0:
        raise ValueError("k and v have sequence length 0: attention needs at least one key")


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
                        qk_precision: str = reference.QK_PRECISION_DEFAULT, return_qk_choice: bool = False):
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
    default) takes ``sageattn3.reference.QK_SCALE_SEARCH`` (False unless set).
    ``qk_precision``: "auto" (the default) decides per head, on the device, whether Q·Kᵀ runs
    with FP4 or MXFP8 operands (``sageattn3.reference.qk_fp4_error`` and ``AUTO_ERROR_LIMIT``: heads
    whose estimated output error from FP4 Q·Kᵀ is large, e.g. RoPE'd biased keys, near-one-hot rows,
    outlier channels; docs/accuracy-auto.md); where no head needs it the output is FP4's bit for
    bit. "fp4": every head FP4 (the rule does not run); "fp8": every head FP8 (D 64/128, not with
    ``qk_rotation``). P·V stays NVFP4. ``return_qk_choice=True`` (outside torch.compile) returns
    ``(out, QkChoice)``: which heads ran FP8 and the rule's estimates (``qk_choice``).

    Under ``torch.compile`` (``fullgraph=True`` works): the path is decided when tracing; the
    FP4 path is the custom op ``torch.ops.sageattn3.attention`` (not differentiable, like the
    kernel itself), the SDPA path stays in the graph."""
    if attn_mask is not None:
        raise NotImplementedError(
            "sageattn3_blackwell does not support attn_mask (it is never silently ignored); use "
            "is_causal=True for causal masking or torch.nn.functional.scaled_dot_product_attention"
        )
    flags = _flags(is_causal=is_causal, per_block_mean=per_block_mean, qk_rotation=qk_rotation, qk_balance=qk_balance)
    search = _search(qk_scale_search)
    precision = reference.qk_precision_arg(qk_precision)
    if reference.flag(return_qk_choice, "return_qk_choice"):
        if torch.compiler.is_compiling():
            raise NotImplementedError("return_qk_choice=True is a debugging aid of eager calls; under torch.compile "
                                      "call sageattn3.qk_choice(q, k, v) outside the compiled region")
        choice: list[QkChoice] = []
        out = _eager_call(q, k, v, *flags, search, precision, choice)
        return out, (choice[0] if choice else QkChoice.fp4_path(q, precision, "the FP4 kernel did not run (SDPA)"))
    if torch.compiler.is_compiling():
        return _traced(q, k, v, *flags, search, precision)
    return _eager_call(q, k, v, *flags, search, precision)


@dataclass(frozen=True)
class QkChoice:
    """Which heads of a call ran Q·Kᵀ in FP8, and why (``qk_precision``): ``fp8`` (B, Hq) bool and
    ``error`` (B, Hq) float32 (the rule's estimate of the relative output error FP4 Q·Kᵀ causes,
    ``reference.qk_fp4_error``; None where the rule did not run), both on the inputs' device;
    ``precision`` the argument; ``note`` why the rule did not run, if it did not."""

    precision: str
    fp8: torch.Tensor
    error: torch.Tensor | None
    note: str = ""

    @staticmethod
    def fp4_path(q: torch.Tensor, precision: str, note: str) -> "QkChoice":
        return QkChoice(precision, torch.zeros(q.shape[:2], dtype=torch.bool, device=q.device), None, note)

    def describe(self) -> str:
        """One line per call: the rule, the limit and each head's estimate and choice."""
        if self.error is None:
            return f"qk_precision={self.precision!r}: every head FP4 ({self.note or 'the rule did not run'})"
        err, sel = self.error.float().cpu(), self.fp8.cpu()
        heads = ", ".join(f"{'fp8' if bool(f) else 'fp4'} ({float(e):.3f})" for f, e in zip(sel.flatten(), err.flatten()))
        return (f"qk_precision={self.precision!r}, limit {reference.AUTO_ERROR_LIMIT}: "
                f"{int(sel.sum())} of {sel.numel()} heads FP8; per head: {heads}")


def _flags(**named) -> tuple[bool, ...]:
    """The boolean keywords of a call, each checked (``reference.flag``: a string such as
    "False" or None is a TypeError, never silently true or false), in the order given."""
    return tuple(reference.flag(value, name) for name, value in named.items())


def _search(qk_scale_search: bool | None) -> bool:
    """The scale search a call asked for (None: ``reference.QK_SCALE_SEARCH``), as a bool."""
    return reference.flag(reference.QK_SCALE_SEARCH if qk_scale_search is None else qk_scale_search,
                          "qk_scale_search")


def _eager_call(q, k, v, is_causal: bool, per_block_mean: bool,
                qk_rotation: bool = reference.QK_ROTATION_DEFAULT,
                qk_balance: bool = reference.QK_BALANCE_DEFAULT, qk_scale_search: bool = False,
                qk_precision: str = reference.QK_PRECISION_DEFAULT, choice: list | None = None) -> torch.Tensor:
    """What ``sageattn3_blackwell`` does outside torch.compile (the custom op's body)."""
    _check_qkv(q, k, v)
    if q.numel() == 0:
        return q.new_empty(q.shape)
    key = (q.device, q.shape[3])
    why = _paths[key] if key in _paths else _decide(*key)
    if why is None:
        return _fp4_attention(q, k, v, is_causal, per_block_mean, qk_rotation=qk_rotation, qk_balance=qk_balance,
                              qk_scale_search=qk_scale_search, qk_precision=qk_precision, choice=choice)
    if why not in _warned:
        _warn_once(why, stacklevel=4)
    return _sdpa(q, k, v, is_causal)


@torch.library.custom_op("sageattn3::attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                  per_block_mean: bool, qk_rotation: bool, qk_balance: bool, qk_scale_search: bool,
                  qk_precision: str) -> torch.Tensor:
    """``sageattn3_blackwell`` as one op for compiled graphs: the self-check, the fallback and
    the kernels run here, at run time. Contiguous (B, Hq, Sq, D) output, as its fake says."""
    return _eager_call(q, k, v, is_causal, per_block_mean, qk_rotation, qk_balance, qk_scale_search,
                       qk_precision).contiguous()


@_attention_op.register_fake
def _attention_op_fake(q, k, v, is_causal, per_block_mean, qk_rotation, qk_balance, qk_scale_search, qk_precision):
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
            qk_scale_search: bool, qk_precision: str = reference.QK_PRECISION_DEFAULT) -> torch.Tensor:
    """The compiled form of ``sageattn3_blackwell``: only what dynamo traces without breaks."""
    _check_qkv(q, k, v)
    if q.shape[0] == 0 or q.shape[1] == 0 or q.shape[2] == 0:
        return q.new_empty(q.shape)
    if q.shape[3] in _kernels.ATTN_HEAD_DIMS and _compile_path(q.device):
        return torch.ops.sageattn3.attention(q, k, v, is_causal, per_block_mean, qk_rotation, qk_balance,
                                             qk_scale_search, qk_precision)
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
                   qk_precision: str = "fp4", choice: list | None = None) -> torch.Tensor:
    """The FP4 path on validated, non-empty q, k, v: preprocess (new tensors; the inputs are
    only read), then the attention kernel; output (B, Hq, Sq, D) in q's dtype. Every
    allocation names q's device and every op sets its device itself: no device switch here.
    ``qk_precision`` "auto"/"fp8": the rule (torch ops on the device, no synchronisation), the
    MXFP8 operands of the chosen heads and the attention with the per-head precision; "fp4" (and
    where FP8 cannot run, with "auto"): exactly the FP4 path. ``choice``: a list the QkChoice is
    appended to (the debug return)."""
    pre = _preprocess_kernels(q, k, v, per_block_mean, _attn.SEQ_PAD, qk_rotation, qk_balance, qk_scale_search)
    picked = _qk_selection(q, k, v, pre, qk_precision, sm_scale)
    if isinstance(picked, str):
        if choice is not None:
            choice.append(QkChoice.fp4_path(q, qk_precision, picked))
        return _attn.attention_from_preprocessed(pre, is_causal=is_causal, sm_scale=sm_scale, out_dtype=q.dtype,
                                                 trusted=True)
    fp8, err = picked
    if choice is not None:
        choice.append(QkChoice(qk_precision, fp8, err))
    b, hq, hk = q.shape[0], q.shape[1], k.shape[1]
    sel_q = fp8.to(torch.uint8)
    sel_k = fp8.view(b, hk, hq // hk).any(dim=-1).to(torch.uint8)
    q8, q8s = _kernels.mxfp8_smooth_quant(_kernels.aligned(q), pre.mean_q, pre.balance, -1, sel_q, _attn.SEQ_PAD)
    k8, k8s = _kernels.mxfp8_smooth_quant(_kernels.aligned(k), pre.mean_k, pre.balance, 1, sel_k, _attn.SEQ_PAD)
    return _attn.attention_qk8(pre, sel_q, q8, q8s, k8, k8s, is_causal=is_causal, sm_scale=sm_scale, out_dtype=q.dtype)


def _qk_selection(q, k, v, pre: Preprocessed, qk_precision: str, sm_scale: float | None):
    """(fp8 (B, Hq) bool, error (B, Hq)) where the per-head precision applies, else the reason
    (str) every head stays FP4: "fp4" asked, or FP8 unavailable with "auto" ("fp8" raises then)."""
    precision = reference.qk_precision_arg(qk_precision)
    if precision == "fp4":
        return "qk_precision='fp4'"
    b, hq, sq, d = q.shape
    why = None
    if not reference.fp8_applies(pre.qk_rotation, d):
        why = reference.fp8_unavailable(pre.qk_rotation, d)
    elif not _attn.fp8_workspace_fits(b, hq, pre.mean_q.shape[2], sq, pre.k_packed.shape[2]):
        why = (f"the FP8 Q·Kᵀ kernel needs the delta_s workspace to hold one (batch, head) row "
               f"({_attn.WORKSPACE_ENV} is too small for these sequence lengths)")
    if why is not None:
        if precision == "fp8":
            raise ValueError(why)
        return why
    err = _qk_error(q, k, v, pre, sm_scale)
    return reference.choose_qk_precision(precision, err), err


def _qk_error(q, k, v, pre: Preprocessed, sm_scale: float | None) -> torch.Tensor:
    """The rule's estimate (B, Hq): the fused kernel on CUDA where it is built (one launch),
    else ``reference.qk_fp4_error`` (torch ops; the CPU path, and the kernel's oracle)."""
    if (_use_kernels(q) and q.dtype in (torch.float16, torch.bfloat16) and pre.k_block_corr is None
            and _kernels.has_rule_kernel()):
        scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[3])
        return _kernels.qk_rule_error(q, k, v, pre, scale)
    return reference.qk_fp4_error(q, k, v, pre, sm_scale)


def qk_choice(q, k, v, is_causal: bool = False, per_block_mean: bool = True,
              qk_rotation: bool = reference.QK_ROTATION_DEFAULT, qk_balance: bool = reference.QK_BALANCE_DEFAULT,
              qk_scale_search: bool | None = None, qk_precision: str = reference.QK_PRECISION_DEFAULT) -> QkChoice:
    """The per-head Q·Kᵀ precision ``sageattn3_blackwell`` picks for these inputs (the rule alone:
    preprocessing and the estimate, no attention), on any device (the reference on the CPU)."""
    _check_qkv(q, k, v)
    precision = reference.qk_precision_arg(qk_precision)
    rot, bal = _flags(qk_rotation=qk_rotation, qk_balance=qk_balance)
    pre = preprocess(q, k, v, per_block_mean, _attn.SEQ_PAD, rot, bal, qk_scale_search)
    picked = _qk_selection(q, k, v, pre, precision, None)
    if isinstance(picked, str):
        return QkChoice.fp4_path(q, precision, picked)
    return QkChoice(precision, *picked)


def blockscaled_fp4_attn(q, k, v, is_causal: bool = False, per_block_mean: bool = True, sm_scale: float | None = None,
                         qk_rotation: bool = reference.QK_ROTATION_DEFAULT,
                         qk_balance: bool = reference.QK_BALANCE_DEFAULT, qk_scale_search: bool | None = None,
                         qk_precision: str = reference.QK_PRECISION_DEFAULT):
    """The FP4 block-scaled attention kernel itself, without fallback: q, k, v as for
    ``sageattn3_blackwell`` (float16/bfloat16, D 64 or 128, GQA/MQA, any lengths); ``sm_scale``
    defaults to 1/sqrt(D); ``qk_rotation``, ``qk_balance`` and ``qk_scale_search`` as for
    ``sageattn3_blackwell``. Raises
    NotImplementedError when this build has no attention kernel, RuntimeError when the kernel
    cannot run on q's device (the message says why, as ``backend()`` does) or when the device
    failed the self-check."""
    if not _kernels.has_attention_kernel():
        raise NotImplementedError(
            "sageattn3.blockscaled_fp4_attn: the FP4 attention kernel is not implemented in this build "
            f"({_kernels.NOT_LOADED_REASON or 'no blockscaled_fp4_attn op'}); use sageattn3_blackwell "
            "(falls back to SDPA) or sageattn3.reference.sageattn3"
        )
    _check_qkv(q, k, v)
    path = _attention_path(q.device, q.shape[3])
    if not path.is_fp4:
        raise RuntimeError(f"sageattn3.blockscaled_fp4_attn cannot run here: {path.reason}")
    if q.shape[2] == 0 or q.shape[0] == 0 or q.shape[1] == 0:
        return q.new_empty(q.shape)
    if not _checked(q.device):
        raise RuntimeError(f"sageattn3.blockscaled_fp4_attn: {_selfcheck.fallback_reason(_selfcheck.failure(q.device))}")
    causal, pbm, rot, bal = _flags(is_causal=is_causal, per_block_mean=per_block_mean, qk_rotation=qk_rotation,
                                   qk_balance=qk_balance)
    return _fp4_attention(q, k, v, causal, pbm, sm_scale, qk_rotation=rot, qk_balance=bal,
                          qk_scale_search=_search(qk_scale_search),
                          qk_precision=reference.qk_precision_arg(qk_precision))


# ---------------------------------------------------------------------------------------------
# Quantization
# ---------------------------------------------------------------------------------------------


def _kernels_serve(device: torch.device) -> bool:
    return _kernels.kernels_run_on(device) is None


_kernels_serve._dynamo_marked_constant = True  # decided while tracing (see _compile_path)


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
    1. V along the sequence (transposed through shared memory);
    2. two small launches read up to 8 evenly spaced 128-row blocks of each head of Q and K and
       make K's mean, each q head's mean_q_global (``reference.sample_mean``) and, with the
       balance, its exponents from them;
    3. one launch smooths and quantizes every 128-row tile of Q and K, each from one read into
       registers: Q's tiles with their block means (per_block_mean) or mean_q_global, K's with
       K's mean; K's tiles also write delta_key = mean_q_global · K_sᵀ per key and q head (the
       unquantized smoothed row as quantized, from registers) and, with per_block_mean, K's
       quantization residual (``reference.quantize_residual``, one E4M3 byte per element); the
       attention launch adds the block residuals' part from both: precomputed per query block
       and key into a bounded workspace before the attention kernel, or per K tile in it
       (``Preprocessed.delta_s`` materialises it all; ``_attn.delta_s_workspace``).
    ``qk_rotation`` (D 64/128): Q and K rows are rotated in registers before smoothing.
    ``qk_balance=True`` (D 64/128, per_block_mean; off by default): the channel balance
    (``reference.balance_exponents``) from the same sampled blocks; Q and K are scaled by it in
    registers (``Preprocessed.balance``), before the rotation when both are on.
    ``qk_scale_search=True`` (D 64/128; None: ``reference.QK_SCALE_SEARCH``, off unless set): Q
    and K quantized with the NVFP4 scale search (``reference.quantize_rows``).
    Bytes that must move: Q, K, V read (3 x 2 bytes/element) + FP4 written (3 x 0.5625) + the
    sampled blocks (up to 8 x 128 rows per head) and the means. Figures:
    tests/bench/bench_kernels.py. Elsewhere: the reference."""
    _check_qkv(q, k, v)
    per_block_mean, qk_rotation, qk_balance = _flags(per_block_mean=per_block_mean, qk_rotation=qk_rotation,
                                                     qk_balance=qk_balance)
    if not isinstance(pad, int) or pad <= 0 or pad % 16:
        raise ValueError(f"pad must be a positive multiple of 16, got {pad!r}")
    if not _use_kernels(q) or q.shape[2] == 0 or q.shape[0] == 0 or q.shape[1] == 0:
        return reference.preprocess(q, k, v, per_block_mean, pad, qk_rotation=qk_rotation, qk_balance=qk_balance,
                                    qk_scale_search=_search(qk_scale_search))
    d = q.shape[3]
    if d % 16 or d > 256:
        raise ValueError(f"head_dim {d} not supported by the preprocessing kernels (multiple of 16, <= 256)")
    return _preprocess_kernels(q, k, v, per_block_mean, pad, qk_rotation, qk_balance, _search(qk_scale_search))


def _preprocess_kernels(q, k, v, per_block_mean: bool, pad: int, qk_rotation: bool,
                        qk_balance: bool = reference.QK_BALANCE_DEFAULT, qk_scale_search: bool = False) -> Preprocessed:
    """``preprocess`` on the kernels, for checked inputs (the FP4 path calls it directly). At
    head dims 64/128 with up to ``max_correction_heads`` q heads per kv head (the attention
    kernel's cases) one op allocates every output and makes every launch in C++, V's first;
    elsewhere V's launch still comes first, before any other Python: the host work for Q and K
    then overlaps it."""
    b, hq, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    if d in reference.ROTATION_HEAD_DIMS and hq // hk <= _kernels.max_correction_heads(d):
        bal = bool(qk_balance) and per_block_mean and reference.balance_applies(d)
        search = reference.scale_search_applies(qk_scale_search, d)
        rot = bool(qk_rotation)
        qp, qsc, kp, ksc, vp, vsc, mean_q, mean_k, qbar, ds_key, exps, k_res = _kernels.preprocess_qkv(
            _kernels.aligned(q), _kernels.aligned(k), _kernels.aligned(v), pad, per_block_mean, rot, bal, search)
        return Preprocessed(qp, qsc, kp, ksc, vp, vsc, mean_q, mean_k, sq, sk, qbar if per_block_mean else mean_q,
                            ds_key, rot, exps if bal else None, search, k_res if per_block_mean else None)
    # the rest: head dims other than 64/128, or more q heads per kv head than the K kernels take
    # for the per-key correction (delta_key from torch ops then)
    vp, vsc = _kernels.quant_cols(_kernels.aligned(v), pad)
    q, k = _kernels.aligned(q), _kernels.aligned(k)
    k3, q3 = k.view(b * hk, sk, d), q.view(b * hq, sq, d)
    rot = bool(qk_rotation) and d in reference.ROTATION_HEAD_DIMS
    bal = bool(qk_balance) and per_block_mean and reference.balance_applies(d)
    search = reference.scale_search_applies(qk_scale_search, d)
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
        search, None if k_res is None else k_res.view(b, hk, -1, d),
    )


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
