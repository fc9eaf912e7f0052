"""The FP8 P·V path's kernels from Python: V's MXFP8 quantizer (``torch.ops.sageattn3.quant_mxfp8_cols``,
csrc/quant/quant_mxfp8_cols.cu) and the attention with P·V in MXFP8 (the kPV8 kernels of
csrc/attn/attn_fwd_kernel.cuh): ``blockscaled_attn_pv8`` for every head of a call, with FP4 Q·Kᵀ
or the per-head FP8 Q·Kᵀ (``sageattn3_blackwell(..., pv_precision="fp8")``), and
``blockscaled_attn_mixed`` for the heads the rule picks (``pv_precision="auto"``, the default).

V (B, Hkv, Sk, D) becomes ``reference.quantize_mxfp8_transposed`` of V padded with zero keys to
a multiple of the key padding: codes (B, Hkv, D, Sk_p) E4M3 and scales (B, Hkv, D, Sk_p/32)
UE8M0 bytes, bit for bit (``reference.Preprocessed.v8`` / ``v8_scales``), but for a NaN's sign
bit (0x7f or 0xff, both NaN: which one the CPU reference gives depends on its host).
"""

from __future__ import annotations

import math

import torch

from sageattn3 import _attn, _kernels
from sageattn3._kernels import op

MX_BLOCK = 32  # keys per UE8M0 scale (reference.formats.MX_BLOCK)
_V_DTYPES = (torch.float16, torch.bfloat16)


def check_v(v, seq_pad: int) -> None:
    """The checks of ``quant_mxfp8_cols``'s arguments, with messages naming them."""
    if not isinstance(v, torch.Tensor):
        raise TypeError(f"v must be a torch.Tensor, got {type(v).__name__}")
    if v.dtype not in _V_DTYPES:
        raise TypeError(f"v must be float16 or bfloat16, got {str(v.dtype).replace('torch.', '')}")
    if v.dim() < 2:
        raise ValueError(f"v must have at least 2 dims (..., seq, head_dim), got shape {tuple(v.shape)}")
    d = v.shape[-1]
    if d <= 0 or d % 16:
        raise ValueError(f"v's head dim must be a positive multiple of 16, got {d}")
    if v.device.type != "cuda":
        raise ValueError(f"v must be a CUDA tensor, got a tensor on {v.device}")
    if isinstance(seq_pad, bool) or not isinstance(seq_pad, int) or seq_pad <= 0 or seq_pad % MX_BLOCK:
        raise ValueError(f"seq_pad must be a positive multiple of {MX_BLOCK}, got {seq_pad!r}")


def quant_mxfp8_cols(v: torch.Tensor, seq_pad: int = 128,
                     sel: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """V (..., S, D) fp16/bf16 on the GPU -> (codes float8_e4m3fn (..., D, Sp), scales uint8
    (..., D, Sp/32)), Sp = S rounded up to ``seq_pad`` (a multiple of 32; zero keys): MXFP8 along
    the sequence, ``reference.quantize_mxfp8_transposed(reference.pad_dim(v, -2, seq_pad))`` bit for
    bit. A non-contiguous or misaligned v is copied first. ``sel``: None (every head), or one uint8
    per (..., ) group (the rule's sel_v): groups whose byte is 0 are skipped, their outputs left
    uninitialised (no kernel reads them)."""
    check_v(v, seq_pad)
    if not v.is_contiguous() or v.data_ptr() % 16:
        v = v.clone(memory_format=torch.contiguous_format)
    *lead, s, d = v.shape
    sp = -(-s // seq_pad) * seq_pad
    codes = torch.empty((*lead, d, sp), dtype=torch.float8_e4m3fn, device=v.device)
    scales = torch.empty((*lead, d, sp // MX_BLOCK), dtype=torch.uint8, device=v.device)
    if sel is not None and (sel.dtype != torch.uint8 or sel.numel() != math.prod(lead) or sel.device != v.device):
        raise ValueError(f"sel must be uint8 with one byte per group of v {tuple(lead)} on {v.device}, got "
                         f"{sel.dtype} of shape {tuple(sel.shape)} on {sel.device}")
    none = _kernels._none(v.device, 11)
    op("quant_mxfp8_cols")(v, none if sel is None else sel.contiguous(), codes, scales)
    return codes, scales


def attention_pv8(pre, v8: torch.Tensor, v8_scales: torch.Tensor, *, head_sel: torch.Tensor | None = None,
                  q8: torch.Tensor | None = None, q8_scales: torch.Tensor | None = None,
                  k8: torch.Tensor | None = None, k8_scales: torch.Tensor | None = None, is_causal: bool = False,
                  sm_scale: float | None = None, out_dtype: torch.dtype = torch.bfloat16,
                  workspace_limit: int | None = None, by_head: bool = False, raw: tuple | None = None) -> torch.Tensor:
    """The attention with P·V in MXFP8 (``reference.sageattn3(..., pv_precision="fp8")``) on a
    ``reference.Preprocessed`` straight from the preprocessing (pad=128): v8 (B, Hkv, D, Sk_p) E4M3
    and v8_scales (B, Hkv, D, Sk_p/32) UE8M0 (``quant_mxfp8_cols(v, 128)``, or ``pre.v8`` /
    ``pre.v8_scales`` of the reference). Q·Kᵀ in FP4, or with ``head_sel`` (B, Hq) per head as
    ``_attn.attention_qk8`` (q8, q8_scales, k8, k8_scales then required). Like FP8 Q·Kᵀ it reads
    delta_s rows: with per-block Q means the workspace must hold one (batch, q head) row
    (``_attn.fp8_workspace_fits``). ``by_head``: both precisions per head from ``head_sel``'s bits
    (the rule's sel_q: bit 0 FP8 Q·Kᵀ, bit 1 FP8 P·V; pre's NVFP4 V for heads without bit 1, v8
    needed only for the kv heads of those with it). ``raw``: as ``_attn.attention_qk8``'s."""
    q = pre.q_packed
    d = 2 * q.shape[3]
    v8, v8_scales = v8.contiguous(), v8_scales.contiguous()  # the reference's codes are a transposed view
    scale = _attn.attention_scale(d, sm_scale, pre.qk_rotation)
    nblk = pre.mean_q.shape[2]
    if not _attn.fp8_workspace_fits(q.shape[0], q.shape[1], nblk, pre.seq_q, pre.k_packed.shape[2], workspace_limit):
        raise ValueError(_attn.PV8_WORKSPACE_REFUSAL)
    out = torch.empty((q.shape[0], q.shape[1], pre.seq_q, d), dtype=out_dtype, device=q.device)
    k_res = _kernels._none(q.device, 6) if pre.k_residual is None else pre.k_residual
    work = _attn.delta_s_workspace(q.shape[0], q.shape[1], nblk, pre.seq_q, pre.k_packed.shape[2], q.device,
                                   workspace_limit)
    none = _kernels._none(q.device, 8)
    if head_sel is None:
        sel, q8, q8_scales, k8, k8_scales = none, none, none, none, none
    else:
        sel = _attn.without_raw_bit(head_sel.to(torch.uint8).contiguous(), raw)
        q8, q8_scales, k8, k8_scales = _attn.qk_operands(q8, q8_scales, k8, k8_scales)
    if by_head and head_sel is None:
        raise ValueError("attention_pv8(by_head=True) needs head_sel")
    op("blockscaled_attn_mixed" if by_head else "blockscaled_attn_pv8")(q, pre.q_scales, pre.k_packed, pre.k_scales, pre.v_packed, pre.v_scales,
        _attn.v_exp_bytes(pre.v_exp, q.device), pre.mean_q,
        pre.mean_q_global, pre.delta_key, k_res, work, out, sel, q8, q8_scales, k8, k8_scales, v8, v8_scales,
        *_attn.raw_operands(raw if head_sel is not None else None, d, sm_scale, q.device), pre.seq_q, pre.seq_k,
        scale, is_causal)
    return out
