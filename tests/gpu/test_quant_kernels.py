"""The CUDA NVFP4 kernels, bit for bit against the reference."""

import pytest
import torch

from gpu_common import kernels_or_skip, same_bytes

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def special_values(n, dtype, device):
    """Random data over many magnitudes plus ties, zeros, tiny, huge, inf and NaN blocks."""
    g = torch.Generator(device="cpu").manual_seed(n)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-20, 12, (n,), generator=g).float())
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -2.5, -5.0, 0.0, -0.0, 6.0, 1.0, 2.0])
    x[:16] = ties  # amax 6 -> scale 1 exactly: the ties stay ties
    x[16:32] = 0.0
    x[32:48] = 1e-6
    x[48:64] = 1e30 if dtype == torch.float32 else 60000.0
    x[70] = float("inf")
    x[90] = float("-inf")
    x[100] = float("nan")
    return x.to(dtype).to(device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(16,), (3, 17, 64), (2, 5, 129, 128), (1, 1, 1, 256), (7, 1000, 48)])
def test_rows_bit_exact(dtype, shape):
    sa = kernels_or_skip()
    from sageattn3 import reference as ref

    n = 1
    for s in shape:
        n *= s
    x = special_values(n, dtype, "cuda").reshape(shape) if n >= 128 else torch.randn(shape, dtype=dtype, device="cuda")
    x0 = x.clone()
    p, s = sa.scale_and_quant_fp4(x)
    rp, rs = ref.quantize_rows(x.cpu())
    assert p.is_cuda and p.shape == rp.shape and s.dtype == torch.float8_e4m3fn
    assert same_bytes(p, rp) and same_bytes(s, rs)
    assert same_bytes(x, x0)  # NaN-safe: the input is unchanged bit for bit
    pp, ps = sa.scale_and_quant_fp4_permute(x) if x.dim() >= 2 else (p, s)
    assert same_bytes(pp, rp) and same_bytes(ps, rs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 16), (17, 64), (2, 3, 129, 128), (1, 2, 1000, 48), (1, 1, 333, 80)])
def test_transpose_bit_exact(dtype, shape):
    sa = kernels_or_skip()
    from sageattn3 import reference as ref

    n = 1
    for s in shape:
        n *= s
    x = special_values(n, dtype, "cuda").reshape(shape) if n >= 128 else torch.randn(shape, dtype=dtype, device="cuda")
    x0 = x.clone()
    p, s = sa.scale_and_quant_fp4_transpose(x)
    rp, rs = ref.quantize_transposed(x.cpu())
    assert p.shape == rp.shape and s.shape == rs.shape
    assert same_bytes(p, rp) and same_bytes(s, rs)
    assert same_bytes(x, x0)  # NaN-safe: the input is unchanged bit for bit


def test_non_contiguous_input():
    sa = kernels_or_skip()
    from sageattn3 import reference as ref

    x = torch.randn(4, 64, 32, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
    p, s = sa.scale_and_quant_fp4(x)
    rp, rs = ref.quantize_rows(x.cpu())
    assert same_bytes(p, rp) and same_bytes(s, rs)


def test_large_tensor_rows():
    sa = kernels_or_skip()
    from sageattn3 import reference as ref

    x = torch.randn(64, 4096, 128, dtype=torch.bfloat16, device="cuda")
    p, s = sa.scale_and_quant_fp4(x)
    rp, rs = ref.quantize_rows(x[-2:].cpu())
    assert same_bytes(p[-2:], rp) and same_bytes(s[-2:], rs)
