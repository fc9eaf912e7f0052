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

    # the first two: a tile or two per CTA; then the stage ring wrapping inside one tile (8 key
    # tiles, 3 stages), and more tiles than an H100/H200 has SMs (136 > 132: some CTAs run two
    # tiles, so Q's buffer and the ring pass from one tile to the next, the producer a tile ahead);
    # then 66 query blocks: the delta_s pre-pass stages r in two chunks, the second of 2 rows (its
    # one-row loop), causal and not; then D 64's ring wrapping inside one tile (5 key tiles for 3
    # stages: the producer warpgroup refills stages of the tile the consumers still work on)
    for d, causal, sq, sk, hq, hk in ((128, True, 200, 200, 2, 1), (64, False, 130, 300, 2, 2),
                                      (128, False, 128, 1024, 1, 1), (64, False, 128, 256, 136, 8),
                                      (128, False, 8400, 200, 2, 1), (64, True, 8400, 384, 1, 1),
                                      (64, False, 200, 640, 2, 1), (64, True, 640, 640, 1, 1)):
        q, k, v = make_qkv(1, hq, hk, sq, sk, d, torch.bfloat16)
        pre = ref.preprocess(q, k, v, pad=128)
        out = _attn.attention_from_preprocessed(pre, is_causal=causal)
        torch.cuda.synchronize()
        print(d, causal, sq, sk, float(out.float().abs().mean()))
    # FP8 P·V (pv_precision="fp8"): FP4 Q·Kᵀ, and FP8 Q·Kᵀ on every other head
    from sageattn3 import _pv8

    for d, causal, sq, sk, hq, hk in ((128, True, 200, 200, 2, 1), (64, False, 130, 300, 2, 2),
                                      (128, False, 300, 260, 4, 1), (64, False, 130, 640, 2, 2)):
        q, k, v = make_qkv(1, hq, hk, sq, sk, d, torch.bfloat16)
        pre = ref.preprocess(q, k, v, pad=128, qk_precision="fp8", pv_precision="fp8")
        v8, v8s = _pv8.quant_mxfp8_cols(v, 128)
        out = _pv8.attention_pv8(pre, v8, v8s, is_causal=causal)
        sel = (torch.arange(hq, device="cuda") % 2 == 0).to(torch.uint8).view(1, hq)
        out8 = _pv8.attention_pv8(pre, v8, v8s, head_sel=sel, q8=pre.q8, q8_scales=pre.q8_scales, k8=pre.k8,
                                  k8_scales=pre.k8_scales, is_causal=causal)
        torch.cuda.synchronize()
        print("pv8", d, causal, sq, sk, float(out.float().abs().mean()), float(out8.float().abs().mean()))
        # both precisions per head (the rule's bits: head h takes byte h % 4), V's MXFP8 of the kv
        # heads that need it only (blockscaled_attn_mixed)
        bits = (torch.arange(hq, device="cuda") % 4).to(torch.uint8).view(1, hq)
        sel_v = (bits >> 1).view(1, hk, hq // hk).amax(-1).contiguous()
        v8m, v8ms = _pv8.quant_mxfp8_cols(v, 128, sel=sel_v)
        outm = _pv8.attention_pv8(pre, v8m, v8ms, head_sel=bits, q8=pre.q8, q8_scales=pre.q8_scales, k8=pre.k8,
                                  k8_scales=pre.k8_scales, is_causal=causal, by_head=True)
        torch.cuda.synchronize()
        print("mixed", d, causal, sq, sk, float(outm.float().abs().mean()))
    a = torch.randint(0, 256, (4, 16, 32), dtype=torch.uint8, device="cuda")
    b = torch.randint(0, 256, (4, 8, 32), dtype=torch.uint8, device="cuda")
    s = torch.full((4, 16, 4), 0x38, dtype=torch.uint8, device="cuda")
    _attn.mma_probe(a, b, s, s[:, :8].contiguous(), torch.zeros(4, 16, 8, device="cuda"), 1, 2)
    torch.cuda.synchronize()
    print("ok")


if __name__ == "__main__":
    main()
