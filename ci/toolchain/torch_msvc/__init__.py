"""The torch header problem under nvcc + MSVC: "C2872: 'std': ambiguous symbol" from
``torch/csrc/dynamo/compiled_autograd.h`` (torch 2.7-2.11 seen).

The fix chosen here is the define: torch 2.9+ guards the offending ``if constexpr`` chain with
``#if defined(_WIN32) && (defined(USE_CUDA) || defined(USE_ROCM))``, and every flag profile
defines ``USE_CUDA`` (build_profile.py); torch 2.7/2.8 guard it with a plain ``#ifdef _WIN32``.
Checked against the real header of torch 2.7.1, 2.8.0 and 2.9.1 (guarded), 2.10.0-2.14.1
(fenced off from stable builds, and guarded). Besides, the extension only includes LibTorch's stable
headers; with ``TORCH_TARGET_VERSION`` set, newer torch makes that header an ``#error`` if
anything pulls it in. So no patch of torch's headers is needed for any torch we build against;
:func:`status` checks a real header and says which case it is, so a future torch whose header
loses the guard is caught (then add a ``torch:`` patch in patches/).
"""

from __future__ import annotations

import re
from pathlib import Path

HEADER = "torch/csrc/dynamo/compiled_autograd.h"
# torch 2.9+: `#if defined(_WIN32) && (defined(USE_CUDA) || defined(USE_ROCM))` (needs our
# USE_CUDA); torch 2.7/2.8: a plain `#ifdef _WIN32` (always on under MSVC).
GUARD = re.compile(
    r"#if\s+defined\(_WIN32\)\s*&&\s*\(defined\(USE_CUDA\)\s*\|\|\s*defined\(USE_ROCM\)\)"
    r"|#ifdef\s+_WIN32\b"
)
STABLE_FENCE = re.compile(r"#if\s+!defined\(TORCH_STABLE_ONLY\)\s*&&\s*!defined\(TORCH_TARGET_VERSION\)")


def status(torch_include: Path) -> str:
    """'absent' | 'fenced-off' (stable builds cannot include it; guarded too) | 'guarded'
    (USE_CUDA avoids C2872) | 'needs-patch'."""
    path = Path(torch_include) / HEADER
    if not path.exists():
        return "absent"
    text = path.read_text(errors="replace")
    if "if constexpr" not in text:
        return "guarded"  # nothing MSVC trips on
    if not GUARD.search(text):
        return "needs-patch"
    return "fenced-off" if STABLE_FENCE.search(text) else "guarded"


def status_in_wheel(wheel: Path) -> str:
    """The same verdict for a torch wheel file, reading only the one header from the zip."""
    import tempfile
    import zipfile

    with zipfile.ZipFile(wheel) as z, tempfile.TemporaryDirectory() as tmp:
        name = f"torch/include/{HEADER}"
        if name not in z.namelist():
            return "absent"
        z.extract(name, tmp)
        return status(Path(tmp) / "torch" / "include")
