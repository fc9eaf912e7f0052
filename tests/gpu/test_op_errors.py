"""A direct torch.ops call that breaks an op's invariants must raise a Python RuntimeError
from the C++ re-checks (stable ABI), never crash the process. Run in a subprocess so a crash
is a failing test rather than a dead session."""

import subprocess
import sys

import pytest
import torch

from gpu_common import kernels_or_skip

CASES = {
    "wrong output size": (
        "x = torch.randn(4, 64, device='cuda', dtype=torch.bfloat16)\n"
        "torch.ops.sageattn3.quant_fp4_rows(x, torch.empty(4, 31, dtype=torch.uint8, device='cuda'),"
        " torch.empty(4, 4, dtype=torch.uint8, device='cuda'))",
        "output sizes do not match",
    ),
    "cpu input": (
        "x = torch.randn(4, 64, dtype=torch.bfloat16)\n"
        "torch.ops.sageattn3.quant_fp4_rows(x, torch.empty(4, 32, dtype=torch.uint8, device='cuda'),"
        " torch.empty(4, 4, dtype=torch.uint8, device='cuda'))",
        "",
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
