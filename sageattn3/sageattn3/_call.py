"""The eager FP4 call in one op (``torch.ops.sageattn3.attention_call``, csrc/torch/ops_call.h).

``sageattn3_blackwell`` outside torch.compile used to make four op calls on the "auto" path
(``preprocess_qkv``, ``qk_rule_select``, ``mxfp8_smooth_quant_qk``, the attention) and 20 or more
allocations, one per tensor between them; the host time of a call was theirs. Here Python decides
what those ops would run, from the shapes and the options alone (no synchronisation), and one op
makes the same launches with the same arguments into one allocation: the output is the multi-op
path's bit for bit (tests/gpu/test_call_gpu.py). Where the op does not serve a call (other head dims,
more q heads per kv head than the K kernels correct, a build without the op or the rule kernel,
the debug return ``return_qk_choice``), the multi-op path runs as before.
"""

from __future__ import annotations

import math

import torch

from sageattn3 import _attn, _kernels, reference
from sageattn3._validate import _ATTN_DTYPES

QK_MODES = {"fp4": 0, "auto": 1, "fp8": 2}  # attention_call's qk_mode
PV_MODES = {"fp4": 0, "auto": 1, "fp8": 2}  # and pv_mode


def serves(q, k, pv_rule: bool, pv_precision: str) -> bool:
    """Whether ``attention_call`` runs this call: head dims 64/128, up to ``max_correction_heads``
    q heads per kv head, fp16/bf16, and a build with the op, the rule kernel and (where the call
    takes them) the FP8 P·V kernels."""
    d = q.shape[3]
    return (d in reference.ROTATION_HEAD_DIMS and q.shape[1] // k.shape[1] <= _kernels.max_correction_heads(d)
            and q.dtype in _ATTN_DTYPES and _kernels.loaded() and hasattr(torch.ops.sageattn3, "attention_call")
            and _kernels.has_rule_kernel() and (pv_rule or pv_precision != "fp8" or _pv8_ops()))


def _pv8_ops() -> bool:
    ops = torch.ops.sageattn3
    return hasattr(ops, "blockscaled_attn_mixed") and hasattr(ops, "blockscaled_attn_pv8")


def call(q, k, v, is_causal: bool, per_block_mean: bool, sm_scale: float | None, qk_rotation: bool,
         qk_balance: bool, qk_scale_search: bool, qk_precision: str, pv_precision: str, pv_rule: bool,
         pv_limit: float) -> torch.Tensor:
    """The call of ``api._fp4_attention`` on q, k, v (contiguous, 16-byte aligned), as one op:
    the modes the multi-op path would take (``_qk_choice._qk_selection``'s reasons for keeping every
    head FP4, ``_pv8.attention_pv8``'s refusal without the delta_s workspace), then the op."""
    b, hq, sq, d = q.shape
    skp = -(-k.shape[2] // _attn.SEQ_PAD) * _attn.SEQ_PAD
    bal = bool(qk_balance) and per_block_mean and reference.balance_applies(d)
    search = reference.scale_search_applies(qk_scale_search, d)
    rot = bool(qk_rotation)
    nblk = -(-sq // _attn.SEQ_PAD) if per_block_mean else 1
    limit = _attn.delta_s_workspace_limit() if nblk > 1 else 0
    fits = _attn.fp8_workspace_fits(b, hq, nblk, sq, skp, limit)
    qk_mode = QK_MODES[reference.qk_precision_arg(qk_precision)]
    if qk_mode and (not reference.fp8_applies(rot, d) or not fits):
        why = (reference.fp8_unavailable(rot, d) if not reference.fp8_applies(rot, d) else
               f"the FP8 Q·Kᵀ kernel needs the delta_s workspace to hold one (batch, head) row "
               f"({_attn.WORKSPACE_ENV} is too small for these sequence lengths)")
        if qk_mode == QK_MODES["fp8"]:
            raise ValueError(why)
        qk_mode = 0
    pv_mode = PV_MODES["fp8"] if pv_precision == "fp8" else PV_MODES["auto"] if pv_rule and qk_mode else 0
    if pv_mode == PV_MODES["fp8"] and not fits:
        raise ValueError("the FP8 P·V kernel needs the delta_s workspace to hold one (batch, q head) row: raise "
                         f"{_attn.WORKSPACE_ENV} or pass per_block_mean=False")
    scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(d)
    attn_scale = scale * 64.0 / d if rot else scale  # rotate(q) . rotate(k) = (D/64) q . k (a power of two)
    rule_scale = scale / (d / 64.0) if rot else scale  # _kernels._rule_scale
    floor = rot or bal or search  # reference.rule_has_options
    args = (q, k, v, bool(is_causal), bool(per_block_mean), rot, bal, search, qk_mode, pv_mode, attn_scale,
            rule_scale, floor, float(reference.AUTO_ERROR_LIMIT), float(pv_limit), int(limit))
    if q.requires_grad or k.requires_grad or v.requires_grad:
        with torch.no_grad():  # a returned tensor would get a grad_fn; the kernels are not differentiable
            return _kernels.op("attention_call")(*args)
    return _kernels.op("attention_call")(*args)
