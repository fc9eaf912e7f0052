"""The eager FP4 call in one op (``torch.ops.sageattn3.attention_call``, csrc/torch/ops_call.h).

``sageattn3_blackwell`` (eager, and inside the ``sageattn3::attention`` op that torch.compile keeps
in its graphs) used to make five op calls on the default path (``preprocess_qkv``,
``qk_rule_select``, ``mxfp8_smooth_quant_qk``, V's ``quant_mxfp8_cols``, the attention) and over 20
allocations, one per tensor between them; the host time of a call was theirs. Here Python decides
what those ops would run, from the shapes and the options alone (no synchronisation; once per call
signature), and one op runs the same kernels with the same arguments into one allocation, in fewer
launches (no memsets; V's MXFP8 with Q's and K's: csrc/torch/ops_call.h): the output is the
multi-op path's bit for bit (tests/gpu/test_call_gpu.py). Where the op does not serve a call (other head dims,
more q heads per kv head than the K kernels correct, a build without the op or the rule kernel,
the debug return ``return_qk_choice``), the multi-op path runs as before.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from sageattn3 import _attn, _kernels, reference
from sageattn3._preprocess_api import kernel_options
from sageattn3._qk_choice import _scale, fp8_refusal
from sageattn3._validate import _ATTN_DTYPES

QK_MODES = {"fp4": 0, "auto": 1, "fp8": 2}  # attention_call's qk_mode
PV_MODES = {"fp4": 0, "auto": 1, "fp8": 2}  # and pv_mode


_PLANS: dict = {}  # call's arguments after q, k, v, per call signature (bounded: cleared when full)
_MAX_PLANS = 1024


@functools.cache
def _op_built() -> bool:
    """Whether this build has the op (asked once: the extension loads with ``_kernels``)."""
    return _kernels.loaded() and hasattr(torch.ops.sageattn3, "attention_call")


def serves(q, k) -> bool:
    """Whether ``attention_call`` runs this call: head dims 64/128, up to ``max_correction_heads``
    q heads per kv head, fp16/bf16, and a build with the op (the same op table holds the rule's,
    the MXFP8 and the FP8 P·V ops it launches for: csrc/torch/ops.h)."""
    d = q.shape[3]
    return (_op_built() and d in reference.ROTATION_HEAD_DIMS and q.dtype in _ATTN_DTYPES
            and q.shape[1] // k.shape[1] <= _kernels.max_correction_heads(d))


def call(q, k, v, is_causal: bool, per_block_mean: bool, sm_scale: float | None, qk_rotation: bool,
         qk_balance: bool, qk_scale_search: bool, qk_precision: str, pv_precision: str, pv_rule: bool,
         pv_limit: float) -> torch.Tensor:
    """The call of ``api._fp4_attention`` on q, k, v (contiguous, 16-byte aligned), as one op:
    the modes the multi-op path would take, decided by the same helpers (``_qk_choice.fp8_refusal``
    for keeping every head FP4 or refusing "fp8", ``_attn.PV8_WORKSPACE_REFUSAL`` for FP8 P·V without
    the delta_s workspace, ``_kernels._rule_scale`` for the rule's scale and floor,
    ``_attn.attention_scale``), then the op."""
    if type(qk_scale_search) is not bool:  # resolved by the caller, as _preprocess_kernels takes it
        raise TypeError(f"_call.call: qk_scale_search must be a resolved bool, got {qk_scale_search!r}")
    b, hq, sq, d = q.shape
    qblk = -(-sq // _attn.SEQ_PAD)
    nblk = qblk if per_block_mean else 1
    limit = _attn.delta_s_workspace_limit() if nblk > 1 else 0  # read on every call (it may change)
    scale = None if sm_scale is None else float(sm_scale)
    pvl, auto = float(pv_limit), reference.rule_limit(sq)  # -1 on short queries: every head leaves FP4
    # the raw 16-bit rows' limit, off (-1) where Q or K holds fewer rows than a TMA box of them
    q16 = float(reference.QK16_STAT_LIMIT) if reference.raw16_fits(q, k) else -1.0
    # the decisions depend on these alone (the lengths through their 128-row blocks): made once
    # per signature (a refusal is raised, never kept; a NaN is never a key)
    key = (b, hq, qblk, d, -(-k.shape[2] // _attn.SEQ_PAD), is_causal, per_block_mean, scale, qk_rotation, qk_balance,
           qk_scale_search, qk_precision, pv_precision, pv_rule, pvl, limit, auto, q16)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _plan(q, k, is_causal, per_block_mean, scale, qk_rotation, qk_balance, qk_scale_search,
                     qk_precision, pv_precision, pv_rule, pvl, nblk, limit, auto, q16)
        if scale == scale and pvl == pvl and auto == auto and q16 == q16:
            if len(_PLANS) >= _MAX_PLANS:
                _PLANS.clear()
            _PLANS[key] = plan
    if q.requires_grad or k.requires_grad or v.requires_grad:
        with torch.no_grad():  # a returned tensor would get a grad_fn; the kernels are not differentiable
            return _kernels.op("attention_call")(q, k, v, *plan)
    return _kernels.op("attention_call")(q, k, v, *plan)


def _plan(q, k, is_causal: bool, per_block_mean: bool, sm_scale: float | None, qk_rotation: bool, qk_balance: bool,
          qk_scale_search: bool, qk_precision: str, pv_precision: str, pv_rule: bool, pv_limit: float, nblk: int,
          limit: int, auto_limit: float, qk16_limit: float) -> tuple:
    """``attention_call``'s arguments after q, k, v for this call (call's decisions; ``nblk`` Q's
    mean rows, ``limit`` the delta_s workspace's bytes, 0 with one Q mean; ``auto_limit`` the
    rule's limit, ``reference.rule_limit(sq)`` as the key read it; ``qk16_limit``
    ``reference.QK16_STAT_LIMIT``, the raw 16-bit rows' at D 128)."""
    b, hq, sq, d = q.shape
    skp = -(-k.shape[2] // _attn.SEQ_PAD) * _attn.SEQ_PAD
    rot, bal, search = kernel_options(d, per_block_mean, qk_rotation, qk_balance, qk_scale_search)
    opts = SimpleNamespace(qk_rotation=rot, qk_scale_search=search, balance=True if bal else None)
    fits = _attn.fp8_workspace_fits(b, hq, nblk, sq, skp, limit)
    qk_mode = QK_MODES[reference.qk_precision_arg(qk_precision)]
    why = fp8_refusal(opts.qk_rotation, d, lambda: fits) if qk_mode else None
    if why is not None:
        if qk_mode == QK_MODES["fp8"]:
            raise ValueError(why)
        qk_mode = 0
    pv_mode = PV_MODES["fp8"] if pv_precision == "fp8" else PV_MODES["auto"] if pv_rule and qk_mode else 0
    if pv_mode == PV_MODES["fp8"] and not fits:
        raise ValueError(_attn.PV8_WORKSPACE_REFUSAL)
    scale = _scale(q, sm_scale)
    rule_scale, _, floor = _kernels._rule_scale(opts, d, scale)  # the options as the Preprocessed would hold them
    return (bool(is_causal), bool(per_block_mean), opts.qk_rotation, opts.balance is not None, opts.qk_scale_search,
            qk_mode, pv_mode, _attn.attention_scale(d, sm_scale, opts.qk_rotation), rule_scale, floor,
            auto_limit, float(pv_limit), float(qk16_limit) if d == 128 else -1.0, int(limit))
