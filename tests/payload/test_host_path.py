"""The Python of one call (docs/performance.md, section 5) on the CPU, where it does not need the
kernels: the checked boolean keywords' fast path and ``_kernels.aligned_eager``, which the FP4 path
applies to q, k, v once per call for every op after it."""

import pytest
import torch

from sageattn3 import _kernels
from sageattn3._validate import _flags


def test_flags_pass_bools_through_and_check_the_rest():
    assert _flags(is_causal=True, per_block_mean=False) == (True, False)
    assert _flags(is_causal=1, per_block_mean=False) == (True, False)
    got = _flags(a=True, b=0)
    assert got == (True, False) and all(type(x) is bool for x in got)
    with pytest.raises(TypeError, match="per_block_mean must be True or False, got 'False'"):
        _flags(is_causal=True, per_block_mean="False")
    with pytest.raises(TypeError, match="is_causal must be True or False, got None"):
        _flags(is_causal=None, per_block_mean=True)


def test_aligned_eager_copies_only_what_it_must():
    x = torch.randn(2, 3, 16, 8)
    assert _kernels.aligned_eager(x) is x  # contiguous and aligned: the tensor itself, no copy
    t = x.transpose(1, 2)  # a strided view: one contiguous copy
    got = _kernels.aligned_eager(t)
    assert got.is_contiguous() and torch.equal(got, t) and got.data_ptr() % 16 == 0
    flat = torch.randn(65)
    off = flat[1:].view(4, 16)  # contiguous, 4 bytes past a 16-byte boundary: a clone
    assert off.data_ptr() % 16 == 4
    got = _kernels.aligned_eager(off)
    assert got.data_ptr() % 16 == 0 and torch.equal(got, off) and got.data_ptr() != off.data_ptr()
