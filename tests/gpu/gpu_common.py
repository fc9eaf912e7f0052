"""Helpers for the GPU tests: the installed package and kernel availability."""

from pathlib import Path

import pytest
import torch


def sageattn3_or_skip():
    import sageattn3

    src = (Path(__file__).resolve().parents[2] / "sageattn3").resolve()
    if Path(sageattn3.__file__).resolve().is_relative_to(src):
        pytest.skip("sageattn3 was imported from the source tree: run tests/gpu alone, against the installed wheel")
    return sageattn3


def kernels_or_skip():
    sageattn3 = sageattn3_or_skip()
    from sageattn3 import _kernels

    why = _kernels.kernels_run_on(torch.device("cuda", torch.cuda.current_device()))
    if why is not None:
        pytest.skip(f"quantization kernels cannot run here: {why}")
    return sageattn3


def same_bytes(a, b):
    a, b = a.contiguous(), b.contiguous()
    return a.shape == b.shape and torch.equal(a.view(torch.uint8).cpu(), b.view(torch.uint8).cpu())


FP4_CCS = ((12, 0), (12, 1))  # block-scaled FP4 MMA in hardware


def fp4_path_or_skip(monkeypatch):
    """sageattn3 with the FP4 path forced on (sm_90 needs the MMA-model test flavour) and the
    self-check allowed to run; skips where no FP4 path can be taken."""
    sa = sageattn3_or_skip()
    from sageattn3 import _attn, _kernels, _selfcheck

    if not _attn.has_kernel():
        pytest.skip("this wheel has no blockscaled_fp4_attn op")
    cc = torch.cuda.get_device_capability()
    if cc not in FP4_CCS and not _kernels.mma_model_build():
        pytest.skip(f"sm_{cc[0]}{cc[1]} without the MMA-model test flavour: no FP4 path to test")
    monkeypatch.setenv(_kernels.FORCE_FP4_ENV, "1")
    monkeypatch.delenv(_selfcheck.SKIP_ENV, raising=False)
    b = sa.backend()
    if not b.startswith("fp4"):
        pytest.skip(f"the FP4 path is not taken here: {b}")
    return sa
