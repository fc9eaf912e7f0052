"""An E4M3 oracle independent of any float8 conversion: every finite value decoded from its byte
by hand, and float64 rounding to the nearest of them (ties to the even code). The MXFP8 tests of
the reference (Q·Kᵀ and P·V) check the quantizers against it."""

import torch


def e4m3_grid() -> tuple[torch.Tensor, torch.Tensor]:
    """Every finite E4M3 value (float64) and its code, from the bytes (no conversion involved)."""
    codes = torch.arange(256, dtype=torch.int64)
    sign = torch.where(codes >= 128, -1.0, 1.0).double()
    e = (codes >> 3) & 15
    m = (codes & 7).double()
    mag = torch.where(e == 0, m * 2.0 ** -9, (1 + m / 8) * torch.exp2((e - 7).double()))
    finite = (codes & 0x7F) != 0x7F
    return (sign * mag)[finite], codes[finite]


def nearest_e4m3(y: torch.Tensor) -> torch.Tensor:
    """Round float64 y to the nearest E4M3 value, ties to the even code."""
    grid, codes = e4m3_grid()
    dist = (y.double().reshape(-1, 1) - grid.reshape(1, -1)).abs()
    best = dist.min(dim=1, keepdim=True).values
    cand = torch.where(dist == best, (codes.reshape(1, -1) & 1).double(), torch.full_like(dist, 2.0))
    return grid[cand.argmin(dim=1)].reshape(y.shape)
