"""The ABI guard: before the compiled extension is loaded, check that the torch in this
process is one the wheel was built for. A mismatch raises ImportError naming the wheel's
torch/CUDA, the user's, and the command that installs the right wheel; never an
"undefined symbol" from the dynamic loader."""

from __future__ import annotations

import json
import re
from importlib import resources

# Where the wheels are published; the factory writes the real root into the build record
# (ci/targets.toml [package] index_url, or SAGEATTN3_INDEX_URL at build time).
DEFAULT_INDEX_URL = "https://sageattn3.github.io/sageattn3"


class TorchMismatchError(ImportError):
    pass


def build_record() -> dict:
    try:
        return json.loads(resources.files("sageattn3").joinpath("_build_record.json").read_text())
    except FileNotFoundError:
        return {}


def _line(version: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def _cuda_tag(cuda: str | None) -> str:
    if not cuda:
        return "cpu"
    major, minor = cuda.split(".")[:2]
    return f"cu{major}{minor}"


def check_torch(torch_version: str, torch_cuda: str | None, record: dict | None = None) -> None:
    """Raise TorchMismatchError when this wheel cannot load into that torch."""
    rec = build_record() if record is None else record
    if not rec:
        return  # a source tree without a record: nothing to check against
    variant = rec.get("variant", "")
    m = re.match(r"cu(\d+)(\d)\.torch(\d+\.\d+)(\.stable)?$", variant)
    if not m:
        return
    cuda_major = int(m.group(1))
    floor = _line(m.group(3))
    stable = bool(m.group(4))
    have = _line(torch_version)
    problems = []
    if torch_cuda is None:
        problems.append("your torch is a CPU-only build")
    elif int(torch_cuda.split(".")[0]) != cuda_major:
        problems.append(f"your torch uses CUDA {torch_cuda}, this wheel CUDA {cuda_major}.x")
    if stable and have < floor:
        problems.append(f"this wheel needs torch >= {m.group(3)}")
    if not stable and have != floor:
        problems.append(f"this wheel is for torch {m.group(3)}.x only")
    if not problems:
        return
    base = (rec.get("index_url") or DEFAULT_INDEX_URL).rstrip("/")
    right = f"{base}/{_cuda_tag(torch_cuda)}/torch{have[0]}.{have[1]}/"
    raise TorchMismatchError(
        f"sageattn3 {rec.get('version', '?')} was built for {rec.get('requires_torch', 'torch ?')} "
        f"with CUDA {rec.get('cuda', '?')} (variant {variant}), but this process has torch "
        f"{torch_version} (CUDA {torch_cuda or 'none'}): {'; '.join(problems)}. Install the wheel "
        f"that matches your torch:\n    pip install --force-reinstall --no-deps sageattn3 --index-url {right}"
    )
