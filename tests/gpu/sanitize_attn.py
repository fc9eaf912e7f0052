"""Small FP4 attention calls for compute-sanitizer (memcheck / racecheck):
    compute-sanitizer --tool memcheck python3 tests/gpu/sanitize_attn.py
    compute-sanitizer --tool racecheck python3 tests/gpu/sanitize_attn.py
Needs a wheel whose attention kernel runs on this GPU (the MMA-model flavour on sm_90)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from attn_common import make_qkv  # noqa: E402


def main() -> None:
    from sageattn3 import _attn
    from sageattn3 import reference as ref

    for d, causal, sq, sk, hq, hk in ((128, True, 200, 200, 2, 1), (64, False, 130, 300, 2, 2)):
        q, k, v = make_qkv(1, hq, hk, sq, sk, d, torch.bfloat16)
        pre = ref.preprocess(q, k, v, pad=128)
        out = _attn.attention_from_preprocessed(pre, is_causal=causal)
        torch.cuda.synchronize()
        print(d, causal, sq, sk, float(out.float().abs().mean()))
    a = torch.randint(0, 256, (4, 16, 32), dtype=torch.uint8, device="cuda")
    b = torch.randint(0, 256, (4, 8, 32), dtype=torch.uint8, device="cuda")
    s = torch.full((4, 16, 4), 0x38, dtype=torch.uint8, device="cuda")
    _attn.mma_probe(a, b, s, s[:, :8].contiguous(), torch.zeros(4, 16, 8, device="cuda"), 1, 2)
    torch.cuda.synchronize()
    print("ok")


if __name__ == "__main__":
    main()
