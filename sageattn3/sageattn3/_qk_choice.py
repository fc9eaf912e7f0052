"""The per-head Q·Kᵀ precision (``qk_precision``): the rule's selection, its estimate and the
public ``QkChoice`` / ``qk_choice`` (re-exported by ``sageattn3.api``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from sageattn3 import _attn, _kernels, reference
from sageattn3._preprocess_api import _use_kernels, preprocess
from sageattn3._validate import _ATTN_DTYPES, _check_qkv, _flags
from sageattn3.reference import Preprocessed


@dataclass(frozen=True)
class QkChoice:
    """Which heads of a call ran Q·Kᵀ in FP8 (at head dim 64: bf16 rows, the 16-bit Q·Kᵀ; still
    named "fp8" here), and why (``qk_precision``): ``fp8`` (B, Hq) bool and
    ``error`` (B, Hq) float32 (the rule's estimate of the relative output error FP4 Q·Kᵀ causes,
    sqrt(r + 3·se) with r the squared error ratio over the sampled rows and se its standard error,
    0 where every row is read: ``reference.qk_fp4_error``; None where the rule did not run), both
    on the inputs' device;
    ``precision`` the argument; ``note`` why the rule did not run, if it did not."""

    precision: str
    fp8: torch.Tensor
    error: torch.Tensor | None
    note: str = ""
    pv_fp8: torch.Tensor | None = None  # (B, Hq) bool: the heads whose P·V ran in MXFP8 (pv_precision "auto")
    pv_error: torch.Tensor | None = None  # (B, Hq) float32: the rule's P estimate (reference.pv_p_error)
    # D 128: (B, Hq) bool, the heads of ``fp8`` whose Q·Kᵀ multiplied the raw 16-bit rows instead of
    # MXFP8 (reference.choose_qk16), and (B, Hq) float32 the statistic it came from (reference.qk16_stat)
    qk16: torch.Tensor | None = None
    qk16_stat: torch.Tensor | None = None
    # the limit the estimates were compared with (``reference.rule_limit``; -1 on a short query:
    # every head leaves FP4); None where the rule did not run
    limit: float | None = None

    @staticmethod
    def fp4_path(q: torch.Tensor, precision: str, note: str) -> "QkChoice":
        return QkChoice(precision, torch.zeros(q.shape[:2], dtype=torch.bool, device=q.device), None, note)

    def describe(self) -> str:
        """One line per call: the rule, the limit and each head's estimate and choice."""
        if self.error is None:
            return f"qk_precision={self.precision!r}: every head FP4 ({self.note or 'the rule did not run'})"
        err, sel = self.error.float().cpu(), self.fp8.cpu()
        raw = self.qk16.cpu().flatten() if self.qk16 is not None else torch.zeros(sel.numel(), dtype=torch.bool)
        kind = lambda f, r: "16-bit" if bool(r) else "fp8" if bool(f) else "fp4"  # noqa: E731
        heads = ", ".join(f"{kind(f, r)} ({float(e):.3f})" for f, r, e in zip(sel.flatten(), raw, err.flatten()))
        limit = reference.AUTO_ERROR_LIMIT if self.limit is None else self.limit
        rule = "" if self.precision != "auto" else f", limit {limit}" + (
            " (below 0: every head with an estimate leaves FP4, as on 2-127 query rows)" if limit < 0 else "")
        out = f"qk_precision={self.precision!r}{rule}: {int(sel.sum())} of {sel.numel()} heads FP8"
        if self.qk16 is not None:
            out += f" ({int(raw.sum())} of them the raw 16-bit rows, qk16_stat above {reference.QK16_STAT_LIMIT})"
        out += f"; per head: {heads}"
        if self.pv_fp8 is not None and self.pv_error is not None:
            pe, ps = self.pv_error.float().cpu(), self.pv_fp8.cpu()
            heads = ", ".join(f"{'fp8' if bool(f) else 'fp4'} ({float(e):.3f})" for f, e in zip(ps.flatten(), pe.flatten()))
            out += (f"; P·V (pv_precision='auto', limit {reference.PV_ERROR_LIMIT}): {int(ps.sum())} of "
                    f"{ps.numel()} heads FP8; per head: {heads}")
        return out


class Picked(NamedTuple):
    """What the rule picked (``_qk_selection``; the order of ``qk_rule_select``'s outputs): error
    (B, Hq) the Q·Kᵀ estimate; sel_q (B, Hq) uint8, bit 0 FP8 Q·Kᵀ, bit 1 FP8 P·V; sel_k (B, Hkv)
    uint8, 1 where a q head has bit 0; error_pv (B, Hq) P's estimate (NaN where not asked); sel_v
    (B, Hkv) uint8, 1 where a q head has bit 1."""

    error: torch.Tensor
    sel_q: torch.Tensor
    sel_k: torch.Tensor
    error_pv: torch.Tensor
    sel_v: torch.Tensor
    qk16_stat: torch.Tensor | None = None  # D 128: reference.qk16_stat; bit 2 of sel_q where it picked the raw rows

    def choice(self, precision: str, pv: bool, limit: float) -> QkChoice:
        """The debug return: ``pv`` where the P·V rule ran (pv_precision "auto"); ``limit`` the
        rule's (``reference.rule_limit``)."""
        raw = {} if self.qk16_stat is None else {"qk16": (self.sel_q & 4).bool(), "qk16_stat": self.qk16_stat}
        if not pv:
            return QkChoice(precision, (self.sel_q & 1).bool(), self.error, limit=limit, **raw)
        return QkChoice(precision, (self.sel_q & 1).bool(), self.error, pv_fp8=(self.sel_q & 2).bool(),
                        pv_error=self.error_pv, limit=limit, **raw)

def _qk_selection(q, k, v, pre: Preprocessed, qk_precision: str, sm_scale: float | None,
                  workspace_limit: int | None = None, pv_limit: float = -1.0, is_causal: bool = False):
    """A ``Picked`` where the per-head precision applies (sel_q bit 0 where a q head's Q·Kᵀ runs in
    FP8; with ``pv_limit`` >= 0, bit 1 where its P·V does, P's estimate above pv_limit); else the
    reason (str) every head stays FP4: "fp4" asked, or FP8 unavailable with "auto" ("fp8" raises
    then). On the kernels, one op computes it all (no synchronisation); q, k, v are then contiguous
    and 16-byte aligned (``_kernels.aligned``). ``workspace_limit``: the delta_s workspace's bytes
    (``_attn.fp8_workspace_fits``'s ``limit``). ``is_causal``: the call's; P's estimate then masks the
    keys each sampled row does not see (``reference.pv_p_error``)."""
    precision = reference.qk_precision_arg(qk_precision)
    if precision == "fp4":
        return "qk_precision='fp4'"
    b, hq, sq, d = q.shape
    # with the rotation the rule estimates on the rotated rows, and FP8 runs on them
    why = fp8_refusal(pre.qk_rotation, d, lambda: _attn.fp8_workspace_fits(b, hq, pre.mean_q.shape[2], sq,
                                                                          pre.k_packed.shape[2], workspace_limit))
    if why is not None:
        if precision == "fp8":
            raise ValueError(why)
        return why
    if _rule_kernel_serves(q, pre):
        raw = reference.raw16_fits(q, k)  # bit 2 where the raw rows serve
        *picked, stat = _kernels.qk_rule_select(q, k, v, pre, _scale(q, sm_scale), reference.rule_limit(sq),
                                                precision == "fp8", pv_limit, is_causal, qk16_limit=None if raw else -1.0)
        return Picked(*picked, stat if raw else None)
    err = _qk_error(q, k, v, pre, sm_scale)
    fp8 = reference.choose_qk_precision(precision, err, reference.rule_limit(sq))
    if pv_limit >= 0:
        err_pv = reference.pv_p_error(q, k, v, pre, sm_scale, is_causal)
        pv8 = reference.choose_pv_precision("auto", err_pv, pv_limit)
    else:
        err_pv, pv8 = torch.full_like(err, float("nan")), torch.zeros_like(fp8)
    hk = k.shape[1]
    kv = lambda x: x.view(b, hk, hq // hk).any(dim=-1).to(torch.uint8)  # noqa: E731
    stat, raw = None, torch.zeros_like(fp8)
    if reference.raw16_fits(q, k):  # the raw 16-bit rows (choose_qk16)
        stat = reference.qk16_stat(q, k, pre, sm_scale)
        raw = reference.choose_qk16(fp8, stat, d)
    sel_q = fp8.to(torch.uint8) | (pv8.to(torch.uint8) << 1) | (raw.to(torch.uint8) << 2)
    return Picked(err, sel_q, kv(fp8), err_pv, kv(pv8), stat)


def fp8_refusal(rotated: bool, d: int, workspace_fits) -> str | None:
    """Why no head's Q·Kᵀ can run in FP8 (None: it can): the head dim, then (``workspace_fits()``,
    asked only where the head dim allows FP8: it reads the workspace limit) a delta_s workspace
    (``_attn.fp8_workspace_fits``) that cannot hold one (batch, q head) row."""
    if not reference.fp8_applies(rotated, d):
        return reference.fp8_unavailable(rotated, d)
    return None if workspace_fits() else _attn.QK8_WORKSPACE_REFUSAL


def _scale(q, sm_scale: float | None) -> float:
    return sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[3])


def _rule_kernel_serves(q, pre: Preprocessed) -> bool:
    """Whether the fused rule kernel computes the estimate for these inputs (else the reference)."""
    return (_use_kernels(q) and q.dtype in _ATTN_DTYPES and pre.k_block_corr is None
            and _kernels.has_rule_kernel())


def _qk_error(q, k, v, pre: Preprocessed, sm_scale: float | None) -> torch.Tensor:
    """The rule's estimate (B, Hq): the fused kernel on CUDA where it is built (one launch),
    else ``reference.qk_fp4_error`` (torch ops; the CPU path, and the kernel's oracle)."""
    if _rule_kernel_serves(q, pre):
        return _kernels.qk_rule_error(q, k, v, pre, _scale(q, sm_scale))
    return reference.qk_fp4_error(q, k, v, pre, sm_scale)


def qk_choice(q, k, v, is_causal: bool = False, per_block_mean: bool = True,
              qk_rotation: bool = reference.QK_ROTATION_DEFAULT, qk_balance: bool = reference.QK_BALANCE_DEFAULT,
              qk_scale_search: bool | None = None, qk_precision: str = reference.QK_PRECISION_DEFAULT,
              pv_precision: str = reference.PV_PRECISION_DEFAULT) -> QkChoice:
    """The per-head Q·Kᵀ precision ``sageattn3_blackwell`` picks for these inputs (the rule alone:
    preprocessing and the estimate, no attention), on any device (the reference on the CPU), and
    with ``pv_precision="auto"`` (the default) the heads whose P·V it runs in MXFP8 (``is_causal`` as the
    call's: P's estimate depends on it)."""
    _check_qkv(q, k, v)
    precision = reference.qk_precision_arg(qk_precision)
    pv_precision = reference.pv_precision_arg(pv_precision)
    rot, bal = _flags(qk_rotation=qk_rotation, qk_balance=qk_balance)
    pre = preprocess(q, k, v, per_block_mean, _attn.SEQ_PAD, rot, bal, qk_scale_search)
    if _use_kernels(q):
        q, k, v = _kernels.aligned(q), _kernels.aligned(k), _kernels.aligned(v)
    # the P·V rule where the call would run it: the reference, or a build with the FP8 P·V kernels
    # (the self-check of those kernels is the call's, not part of this)
    pv = pv_precision == "auto" and (not _use_kernels(q) or hasattr(torch.ops.sageattn3, "blockscaled_attn_mixed"))
    picked = _qk_selection(q, k, v, pre, precision, None, pv_limit=reference.PV_ERROR_LIMIT if pv else -1.0,
                           is_causal=reference.flag(is_causal, "is_causal"))
    if isinstance(picked, str):
        return QkChoice.fp4_path(q, precision, picked)
    return picked.choice(precision, pv, reference.rule_limit(q.shape[2]))

