"""Classic vs stable torch-facing unit on the GPU: the outputs saved by
`tests/gpu/bindings_compare.py save` under each build (SAGEATTN3_STABLE_OUTPUTS and
SAGEATTN3_CLASSIC_OUTPUTS) are bit-identical over the attention, quantization and preprocessing
shapes. Skips unless both files are named (and without a GPU, like every test here)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bindings_compare import compare


def test_classic_unit_bit_identical_to_stable():
    a, b = os.environ.get("SAGEATTN3_STABLE_OUTPUTS"), os.environ.get("SAGEATTN3_CLASSIC_OUTPUTS")
    if not (a and b):
        pytest.skip("SAGEATTN3_STABLE_OUTPUTS / SAGEATTN3_CLASSIC_OUTPUTS not set (tests/gpu/bindings_compare.py)")
    assert compare(Path(a), Path(b)) == 0
