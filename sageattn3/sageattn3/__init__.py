"""sageattn3: FP4 microscaling attention (SageAttention3) for NVIDIA Blackwell sm_120/sm_121.

An installed wheel carries ``_build_record.json`` and the compiled extension ``_C``: the ABI
guard checks the torch in this process first, then ``_C`` is loaded and any load error
propagates. A source tree without the compiled extension (not built, or built into a wheel
elsewhere) still imports: the reference (``sageattn3.reference``) and the SDPA fallback work,
and ``backend()`` / ``is_available()`` report that the kernels are not built. Under
``python -m sageattn3`` (the diagnosis) a refusal of the guard or a load error is recorded
instead of raised, so that the report can say what is wrong and which wheel fits.
"""

from __future__ import annotations

import importlib.util
import sys

import torch

from sageattn3 import _kernels
from sageattn3._guard import build_record, check_torch
from sageattn3._version import __version__


def _running_the_diagnosis() -> bool:
    """Whether this import is ``python -m sageattn3 ...`` locating its ``__main__`` (Python sets
    ``sys.argv[0]`` to "-m" meanwhile): then an ABI mismatch or a load error of the extension
    is what the diagnosis reports, so it is recorded here instead of raised."""
    if sys.argv[:1] != ["-m"]:
        return False
    orig = getattr(sys, "orig_argv", None)  # Python >= 3.10
    if orig is None:
        return True
    for i, arg in enumerate(orig[1:], 1):
        if arg == "-m":
            return orig[i + 1 : i + 2] == ["sageattn3"]
        if arg.startswith("-m"):
            return arg[2:] == "sageattn3"
    return False


_record = build_record()
if importlib.util.find_spec("sageattn3._C") is not None:
    try:
        check_torch(torch.__version__, torch.version.cuda, _record)
        from sageattn3 import _C  # noqa: F401  (registers torch.ops.sageattn3.*)
    except (ImportError, OSError) as _e:
        if not _running_the_diagnosis():
            raise
        _kernels.LOAD_ERROR = _e
        _kernels.NOT_LOADED_REASON = f"{type(_e).__name__}: {_e}"
    else:
        _kernels.NOT_LOADED_REASON = None
        _kernels.ARCHS = tuple(_record.get("archs") or ())
        _kernels.register_fakes()
else:
    _kernels.NOT_LOADED_REASON = "source tree without the compiled extension sageattn3._C"

from sageattn3.api import (  # noqa: E402
    Preprocessed,
    backend,
    QkChoice,
    blockscaled_fp4_attn,
    is_available,
    preprocess,
    qk_choice,
    sageattn3_blackwell,
    scale_and_quant_fp4,
    scale_and_quant_fp4_permute,
    scale_and_quant_fp4_transpose,
)


from sageattn3._diagnose import diagnose  # noqa: E402


def build_info() -> dict:
    """The build record of this wheel: variant, torch range, CUDA, archs, toolchains, flags
    (empty in a source tree that was never built)."""
    return build_record()


__all__ = [
    "Preprocessed",
    "QkChoice",
    "__version__",
    "backend",
    "blockscaled_fp4_attn",
    "build_info",
    "diagnose",
    "is_available",
    "preprocess",
    "qk_choice",
    "sageattn3_blackwell",
    "scale_and_quant_fp4",
    "scale_and_quant_fp4_permute",
    "scale_and_quant_fp4_transpose",
]
