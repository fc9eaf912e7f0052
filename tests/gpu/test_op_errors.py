"""A direct torch.ops call that breaks an op's invariants must raise a Python RuntimeError
from the C++ re-checks (stable ABI), never crash the process. Run in a subprocess so a crash
is a failing test rather than a dead session."""

import subprocess
import sys

import pytest
import torch

from gpu_common import kernels_or_skip

# Each message names what the op expected and what it got.
OUTS = "torch.empty(4, 32, dtype=torch.uint8, device='cuda'), torch.empty(4, 4, dtype=torch.uint8, device='cuda')"
CASES = {
    "wrong output size": (
        "x = torch.randn(4, 64, device='cuda', dtype=torch.bfloat16)\n"
        "torch.ops.sageattn3.quant_fp4_rows(x, torch.empty(4, 31, dtype=torch.uint8, device='cuda'),"
        " torch.empty(4, 4, dtype=torch.uint8, device='cuda'))",
        "output sizes do not match x: expected packed of 128 and scales of 16 elements, got 124 and 16",
    ),
    "cpu input": (
        "x = torch.randn(4, 64, dtype=torch.bfloat16)\n"
        f"torch.ops.sageattn3.quant_fp4_rows(x, {OUTS})",
        "x must be a CUDA tensor, got a tensor on cpu",
    ),
    "wrong dtype": (
        "x = torch.randn(4, 64, device='cuda', dtype=torch.float64)\n"
        f"torch.ops.sageattn3.quant_fp4_rows(x, {OUTS})",
        "x must be float16, bfloat16 or float32, got float64",
    ),
    "not contiguous": (
        "x = torch.randn(64, 4, device='cuda', dtype=torch.bfloat16).t()\n"
        f"torch.ops.sageattn3.quant_fp4_rows(x, {OUTS})",
        "x must be contiguous, got strides (1, 4) for shape (4, 64)",
    ),
    "misaligned": (
        "x = torch.randn(4 * 64 + 1, device='cuda', dtype=torch.bfloat16)[1:].view(4, 64)\n"
        f"torch.ops.sageattn3.quant_fp4_rows(x, {OUTS})",
        "x must be 16-byte aligned (pass a fresh tensor or .clone()), got an address 2 bytes past a 16-byte boundary",
    ),
    "last dim": (
        "x = torch.randn(4, 40, device='cuda', dtype=torch.bfloat16)\n"
        f"torch.ops.sageattn3.quant_fp4_rows(x, {OUTS})",
        "last dim must be a positive multiple of 16, got x of shape (4, 40)",
    ),
    "scales dtype": (
        "x = torch.randn(4, 64, device='cuda', dtype=torch.bfloat16)\n"
        "torch.ops.sageattn3.quant_fp4_rows(x, torch.empty(4, 32, dtype=torch.uint8, device='cuda'),"
        " torch.empty(4, 4, dtype=torch.int32, device='cuda'))",
        "scales must be uint8 or float8_e4m3fn, got int32",
    ),
    # the preprocessing op handed the one-byte E4M3 residual of earlier releases for K's residual
    "residual dtype": (
        "from sageattn3 import _kernels\n"
        "real = _kernels.op\n"
        "_kernels.op = lambda name: (lambda *a: real(name)(*a[:-1], a[-1].to(torch.float8_e4m3fn))) "
        "if name == 'smooth_quant_qk' else real(name)\n"
        "q = torch.randn(2, 256, 64, device='cuda', dtype=torch.bfloat16)\n"
        "_kernels.smooth_quant_qk_key(q, q.clone(), 128)",
        "k_res (K's quantization residual, reference.quantize_residual) must be float16, got float8_e4m3fn "
        "(a one-byte E4M3 residual of an earlier release is in the same units: .to(torch.float16) converts it "
        "exactly; or run the preprocessing again)",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_op_invariant_violation_is_a_python_error(case):
    kernels_or_skip()
    body, expect = CASES[case]
    code = (
        "import torch, sageattn3\n"
        "try:\n    " + body.replace("\n", "\n    ") + "\n"
        "except RuntimeError as e:\n    print('RAISED', str(e).splitlines()[0][:300])\n"
        "else:\n    print('NO ERROR')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"process died ({proc.returncode}): {proc.stdout}{proc.stderr[-2000:]}"
    assert "RAISED" in proc.stdout and expect in proc.stdout, proc.stdout + proc.stderr[-2000:]
