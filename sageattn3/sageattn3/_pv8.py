"""The FP8 P·V path's kernels from Python (opt-in, ``pv_precision="fp8"``): V's MXFP8 quantizer
(``torch.ops.sageattn3.quant_mxfp8_cols``, csrc/quant/quant_mxfp8_cols.cu).

V (B, Hkv, Sk, D) becomes ``reference.quantize_mxfp8_transposed`` of V padded with zero keys to
a multiple of the key padding: codes (B, Hkv, D, Sk_p) E4M3 and scales (B, Hkv, D, Sk_p/32)
UE8M0 bytes, bit for bit (``reference.Preprocessed.v8`` / ``v8_scales``).
"""

from __future__ import annotations

import torch

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


def quant_mxfp8_cols(v: torch.Tensor, seq_pad: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """V (..., S, D) fp16/bf16 on the GPU -> (codes float8_e4m3fn (..., D, Sp), scales uint8
    (..., D, Sp/32)), Sp = S rounded up to ``seq_pad`` (a multiple of 32; zero keys): MXFP8 along
    the sequence, ``reference.quantize_mxfp8_transposed(reference.pad_dim(v, -2, seq_pad))`` bit for
    bit. A non-contiguous or misaligned v is copied first."""
    check_v(v, seq_pad)
    if not v.is_contiguous() or v.data_ptr() % 16:
        v = v.clone(memory_format=torch.contiguous_format)
    *lead, s, d = v.shape
    sp = -(-s // seq_pad) * seq_pad
    codes = torch.empty((*lead, d, sp), dtype=torch.float8_e4m3fn, device=v.device)
    scales = torch.empty((*lead, d, sp // MX_BLOCK), dtype=torch.uint8, device=v.device)
    op("quant_mxfp8_cols")(v, codes, scales)
    return codes, scales
