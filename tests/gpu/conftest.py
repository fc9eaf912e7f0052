"""GPU tests of the INSTALLED sageattn3 wheel (not the source tree). Every test skips without
CUDA. Run them on their own: `python -m pytest tests/gpu` with the wheel installed (built with
an arch that runs on the GPU at hand, e.g. SAGEATTN3_ARCHS="sm_90a;sm_120a;sm_121a" for an
H100)."""

import sys
from pathlib import Path

import pytest
import torch

SRC = (Path(__file__).resolve().parents[2] / "sageattn3").resolve()
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != SRC]
# Shared test data (tests/attention_cases.py), also when pytest runs from this folder.
TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:
    sys.path.append(str(TESTS))


HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    # This hook sees the whole session's items: mark only the GPU tests of this folder.
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)
