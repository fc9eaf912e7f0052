"""The one-op eager call (``attention_call``: every launch of a call from one allocation) for
compute-sanitizer (memcheck / racecheck), over the precision pairs, the options, one Q mean and
the bounded mode (no delta_s workspace). Its pieces share one allocation, so an overrun into the
next piece is not an error here: the same kernels with separate allocations are sanitize_attn.py's
and sanitize_quant.py's.
    compute-sanitizer --tool memcheck python3 tests/gpu/sanitize_call.py
Needs a wheel whose attention kernel runs on this GPU (the MMA-model flavour on sm_90, where the
FP4 path is forced on here)."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import attention_cases as ac  # noqa: E402


def main() -> None:
    os.environ.setdefault("SAGEATTN3_FORCE_FP4", "1")
    os.environ.setdefault("SAGEATTN3_SKIP_SELFCHECK", "1")
    from sageattn3 import api

    # short calls (every sampled row), ragged lengths, GQA, both head dims; the rule takes some heads
    for case, d, causal, sq, sk, hq, hk, dtype in (("mixed_heads", 128, True, 200, 200, 4, 2, torch.bfloat16),
                                                   ("mixed_heads", 64, False, 130, 300, 4, 2, torch.float16),
                                                   ("large_logits", 128, False, 260, 300, 2, 1, torch.float16)):
        q, k, v = ac.make(case, 1, hq, hk, sq, sk, d, seed=3, dtype=dtype, device="cuda")
        for qk, pv in (("fp4", "fp4"), ("auto", "auto"), ("fp8", "fp4"), ("auto", "fp8"), ("fp4", "fp8"),
                       ("fp8", "auto"), ("fp8", "fp8")):
            for opts in ({}, {"qk_rotation": True, "qk_balance": True, "qk_scale_search": True}):
                out = api.sageattn3_blackwell(q, k, v, is_causal=causal, qk_precision=qk, pv_precision=pv, **opts)
                torch.cuda.synchronize()
                print(case, d, causal, sq, sk, qk, pv, sorted(opts), float(out.float().abs().mean()))
        out = api.sageattn3_blackwell(q, k, v, is_causal=causal, per_block_mean=False)
        torch.cuda.synchronize()
        print(case, d, "one Q mean", float(out.float().abs().mean()))
        os.environ["SAGEATTN3_DELTA_S_WORKSPACE_MIB"] = "0"
        out = api.sageattn3_blackwell(q, k, v, is_causal=causal)
        torch.cuda.synchronize()
        del os.environ["SAGEATTN3_DELTA_S_WORKSPACE_MIB"]
        print(case, d, "bounded mode", float(out.float().abs().mean()))


if __name__ == "__main__":
    main()
