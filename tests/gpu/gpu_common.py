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
