"""The ABI guard: before the compiled extension is loaded, check that the torch in this
process is one the wheel was built for. A mismatch raises ImportError naming the wheel's
torch/CUDA, the user's, and the command that installs the right wheel (the same answer as
``python -m sageattn3 which``: only pages the index serves); never an "undefined symbol" from
the dynamic loader."""

from __future__ import annotations

import json
from importlib import resources

from sageattn3 import _which

DEFAULT_INDEX_URL = _which.DEFAULT_INDEX_URL.rstrip("/")


class TorchMismatchError(ImportError):
    pass


def build_record() -> dict:
    try:
        return json.loads(resources.files("sageattn3").joinpath("_build_record.json").read_text())
    except FileNotFoundError:
        return {}


def _spec(torch_version: str, torch_cuda: str | None) -> _which.TorchSpec:
    """The running torch: its CUDA is torch.version.cuda (None: +cpu, ROCm, ...)."""
    if torch_cuda:
        return _which.torch_spec(torch_version, torch_cuda)
    return _which.torch_spec(torch_version, running=(torch_version, None))


def torch_problems(torch_version: str, torch_cuda: str | None, record: dict | None = None) -> list[str]:
    """Why this wheel cannot load into that torch (empty: it can, or there is nothing to check)."""
    rec = build_record() if record is None else record
    if not rec:
        return []  # a source tree without a record: nothing to check against
    try:
        spec = _spec(torch_version, torch_cuda)
    except _which.TorchVersionError:
        return []  # a version this cannot read (a local build): let the loader decide
    return _which.variant_problems(rec.get("variant", ""), spec) or []


def check_torch(torch_version: str, torch_cuda: str | None, record: dict | None = None) -> None:
    """Raise TorchMismatchError when this wheel cannot load into that torch."""
    rec = build_record() if record is None else record
    problems = torch_problems(torch_version, torch_cuda, rec)
    if not problems:
        return
    raise TorchMismatchError(mismatch_message(torch_version, torch_cuda, rec, problems))


def mismatch_message(torch_version: str, torch_cuda: str | None, rec: dict, problems: list[str]) -> str:
    ans = _which.answer(_spec(torch_version, torch_cuda), rec, reinstall=True)
    if ans.command:
        advice = f"Install the wheel that matches your torch:\n    {ans.command}"
    else:
        advice = (f"No published wheel matches your torch: {ans.reason}. The picker lists every torch line x "
                  f"CUDA: {ans.url}\n    then: pip install --force-reinstall --no-deps sageattn3 --index-url "
                  f"<the page it names>")
    return (
        f"sageattn3 {rec.get('version', '?')} was built for {rec.get('requires_torch', 'torch ?')} "
        f"with CUDA {rec.get('cuda', '?')} (variant {rec.get('variant', '?')}), but this process has torch "
        f"{torch_version} (CUDA {torch_cuda or 'none'}): {'; '.join(problems)}. {advice}"
    )
