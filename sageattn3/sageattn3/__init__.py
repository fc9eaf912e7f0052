"""sageattn3: FP4 microscaling attention (SageAttention3) for NVIDIA Blackwell sm_120/sm_121."""

from __future__ import annotations

import torch

from sageattn3._guard import build_record, check_torch
from sageattn3._version import __version__

check_torch(torch.__version__, torch.version.cuda)

from sageattn3 import _C  # noqa: E402,F401  (registers torch.ops.sageattn3.*)


def build_info() -> dict:
    """The build record of this wheel: variant, torch range, CUDA, archs, toolchains, flags."""
    return build_record()


__all__ = ["__version__", "build_info"]
