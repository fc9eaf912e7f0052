"""sageattn3: FP4 microscaling attention (SageAttention3) for NVIDIA Blackwell sm_120/sm_121.

An installed wheel carries ``_build_record.json`` and the compiled extension ``_C``: the ABI
guard checks the torch in this process first, then ``_C`` is loaded and any load error
propagates. A source tree without the compiled extension (not built, or built into a wheel
elsewhere) still imports: the reference (``sageattn3.reference``) and the SDPA fallback work,
and ``backend()`` / ``is_available()`` report that the kernels are not built.
"""

from __future__ import annotations

import importlib.util

import torch

from sageattn3 import _kernels
from sageattn3._guard import build_record, check_torch
from sageattn3._version import __version__

_record = build_record()
if importlib.util.find_spec("sageattn3._C") is not None:
    check_torch(torch.__version__, torch.version.cuda, _record)
    from sageattn3 import _C  # noqa: E402,F401  (registers torch.ops.sageattn3.*)

    _kernels.NOT_LOADED_REASON = None
    _kernels.ARCHS = tuple(_record.get("archs") or ())
else:
    _kernels.NOT_LOADED_REASON = "source tree without the compiled extension sageattn3._C"

from sageattn3.api import (  # noqa: E402
    Preprocessed,
    backend,
    blockscaled_fp4_attn,
    is_available,
    preprocess,
    sageattn3_blackwell,
    scale_and_quant_fp4,
    scale_and_quant_fp4_permute,
    scale_and_quant_fp4_transpose,
)


def build_info() -> dict:
    """The build record of this wheel: variant, torch range, CUDA, archs, toolchains, flags
    (empty in a source tree that was never built)."""
    return build_record()


__all__ = [
    "Preprocessed",
    "__version__",
    "backend",
    "blockscaled_fp4_attn",
    "build_info",
    "is_available",
    "preprocess",
    "sageattn3_blackwell",
    "scale_and_quant_fp4",
    "scale_and_quant_fp4_permute",
    "scale_and_quant_fp4_transpose",
]
