"""What the per-head Q·Kᵀ precision costs around the attention kernel, timed on a GPU with CUDA
events (median of 10 after warm-up; --rule: of 30):

    python tests/bench/bench_qk_precision.py [--seq S] [--heads H]

- preprocessing alone (``sageattn3.preprocess``: the FP4 path's first step);
- the rule: the fused kernel the API uses on CUDA (``_kernels.qk_rule_error``, its estimate alone) and its
  torch-op oracle (``reference.qk_fp4_error`` on the same preprocessed tensors, on the device);
  and with the balance and the rotation (the rotated rows and the defaults' rows: two estimates,
  options as floors);
- the MXFP8 quantization of Q and K for every head, and with no head selected (the launch the
  "auto" path makes when the rule picks none);
- the FP8 P·V choice (``pv_precision="auto"``, the default): the rule op with P's estimate (its
  blocks) against the same op without it, and V's MXFP8 for every kv head and for none;
- with --rule: only the rule op as the defaults run it (P's estimate on; causal too) and without P's
  estimate, beside the preprocessing, at D 128 and 64, 24 heads x 32k tokens and 8 heads x 4096;
- with --call (needs the attention kernel): the whole call with qk_precision "fp4", "auto" on
  zero-mean data (no head picked) and "fp8" at each --call-seq (fp8 only at the first). On an H100 the attention kernel is the MMA-model test
  flavour (SAGEATTN3_FORCE_FP4=1): its own time is meaningless there; the differences between the
  three calls are the precision's overheads (rule, quantization, the second kernel launch) plus,
  for "fp8", the model's FP8 MMAs.
bf16, batch 1, D 128, Q and K zero-mean (the rule keeps FP4 everywhere)."""

from __future__ import annotations

import argparse
import os

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=24)
    ap.add_argument("--call", action="store_true", help="also time whole calls (slow with the MMA model)")
    ap.add_argument("--call-seq", type=int, nargs="+", default=[4096])
    ap.add_argument("--rule", action="store_true", help="only the rule op, as the defaults run it, at eight shapes")
    args = ap.parse_args()
    if args.rule:
        return rule_shapes()
    os.environ.setdefault("SAGEATTN3_FORCE_FP4", "1")
    import sageattn3
    from bench_kernels import time_ms  # this folder's (imports sageattn3: after the setting above)
    from sageattn3 import _kernels, reference

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    shape = (1, args.heads, args.seq, 128)
    q, k, v = (torch.randn(shape, generator=g, device=dev, dtype=torch.bfloat16) for _ in range(3))
    print(f"device: {torch.cuda.get_device_name()}; {sageattn3.backend()}")
    print(f"shape: batch 1, {args.heads} heads, {args.seq} tokens, D 128, bf16, zero-mean")
    pre = sageattn3.preprocess(q, k, v)
    t_pre = time_ms(lambda: sageattn3.preprocess(q, k, v))
    t_rule = time_ms(lambda: _kernels.qk_rule_error(q, k, v, pre, 128 ** -0.5))
    t_rule_ops = time_ms(lambda: reference.qk_fp4_error(q, k, v, pre))
    ones = torch.ones(shape[:2], dtype=torch.uint8, device=dev)
    zeros = torch.zeros_like(ones)
    # what the defaults run: the FP8 heads' rows rotated in the MXFP8 kernel (means too)
    t_q8 = time_ms(lambda: _kernels.mxfp8_smooth_quant_qk(q, k, pre, ones, ones, 128))
    t_q8_none = time_ms(lambda: _kernels.mxfp8_smooth_quant_qk(q, k, pre, zeros, zeros, 128))
    t_q8_plain = time_ms(lambda: (_kernels.mxfp8_smooth_quant(q, pre.mean_q, None, -1, ones, 128),
                                  _kernels.mxfp8_smooth_quant(k, pre.mean_k, None, 1, ones, 128)))
    pre_opts = sageattn3.preprocess(q, k, v, qk_rotation=True, qk_balance=True)
    t_rule_opts = time_ms(lambda: _kernels.qk_rule_error(q, k, v, pre_opts, 128 ** -0.5))
    err = _kernels.qk_rule_error(q, k, v, pre, 128 ** -0.5)
    err_ops = reference.qk_fp4_error(q, k, v, pre)
    print(f"rule kernel vs torch ops: max rel diff {((err - err_ops).abs() / err_ops.abs()).max().item():.2e}")
    print(f"preprocess {t_pre:.3f} ms | rule kernel {t_rule:.3f} ms ({t_rule / t_pre:.3f}x preprocess; picks "
          f"{int((err > reference.AUTO_ERROR_LIMIT).sum())} of {err.numel()} heads) | rule as torch ops "
          f"{t_rule_ops:.3f} ms | MXFP8 Q+K all heads "
          f"{t_q8:.3f} ms ({t_q8 / t_pre:.2f}x; unrotated, as before: {t_q8_plain:.3f} ms) | MXFP8 launches, "
          f"no head picked {t_q8_none:.3f} ms")
    print(f"rule with the balance and the rotation (two estimates): {t_rule_opts:.3f} ms "
          f"({t_rule_opts / t_rule:.2f}x the defaults' rule)")
    from sageattn3 import _pv8

    lim = reference.AUTO_ERROR_LIMIT
    t_sel = time_ms(lambda: _kernels.qk_rule_select(q, k, v, pre, 128 ** -0.5, lim, False, -1.0))
    t_sel_pv = time_ms(lambda: _kernels.qk_rule_select(q, k, v, pre, 128 ** -0.5, lim, False, reference.PV_ERROR_LIMIT))
    err_pv = _kernels.qk_rule_select(q, k, v, pre, 128 ** -0.5, lim, False, reference.PV_ERROR_LIMIT)[3]
    kv_ones = torch.ones(shape[:2], dtype=torch.uint8, device=dev)
    t_v8 = time_ms(lambda: _pv8.quant_mxfp8_cols(v, 128, sel=kv_ones))
    t_v8_none = time_ms(lambda: _pv8.quant_mxfp8_cols(v, 128, sel=torch.zeros_like(kv_ones)))
    print(f"rule op (qk_rule_select) without P's estimate {t_sel:.3f} ms, with it {t_sel_pv:.3f} ms (+"
          f"{t_sel_pv - t_sel:.3f} ms; P estimates {err_pv.min().item():.3f}-{err_pv.max().item():.3f}, limit "
          f"{reference.PV_ERROR_LIMIT}) | V's MXFP8 every kv head {t_v8:.3f} ms, none {t_v8_none:.3f} ms")
    for n, s in enumerate(args.call_seq if args.call else []):
        qc, kc, vc = q[:, :, :s].contiguous(), k[:, :, :s].contiguous(), v[:, :, :s].contiguous()
        res = {p: time_ms(lambda p=p: sageattn3.sageattn3_blackwell(qc, kc, vc, qk_precision=p), iters=5)
               for p in (("fp4", "auto", "fp8") if n == 0 else ("fp4", "auto"))}
        res["auto, P·V fp4"] = time_ms(lambda: sageattn3.sageattn3_blackwell(qc, kc, vc, pv_precision="fp4"), iters=5)
        print(f"whole call, {s} tokens: " + ", ".join(f"{p} {ms:.3f} ms" for p, ms in res.items())
              + f" (auto - fp4 = {res['auto'] - res['fp4']:.3f} ms; the P·V choice: "
              f"{res['auto'] - res['auto, P·V fp4']:.3f} ms)")
    return 0


def rule_shapes(reps: int = 30) -> int:
    """The rule op as the defaults run it (``qk_rule_select`` with P's estimate; causal too) and
    without P's estimate, beside the preprocessing, at D 128 and 64, 24 heads x 32k tokens and 8
    heads x 4096, 512 and 300 (the short calls read every 2nd row and every row) (bf16, zero-mean data; median of ``reps`` calls, CUDA events around each, the GPU
    idle before each: a figure holds the op's host work too, its allocation and its launches)."""
    os.environ.setdefault("SAGEATTN3_FORCE_FP4", "1")
    import sageattn3
    from bench_kernels import time_ms  # this folder's (imports sageattn3: after the setting above)
    from sageattn3 import _kernels, reference

    def median_ms(fn) -> float:
        return time_ms(fn, iters=reps)

    dev = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name()}; {sageattn3.backend()}")
    lim, pv_lim = reference.AUTO_ERROR_LIMIT, reference.PV_ERROR_LIMIT
    for d in (128, 64):
        for heads, seq in ((24, 32768), (8, 4096), (8, 512), (8, 300)):
            g = torch.Generator(device=dev).manual_seed(0)
            q, k, v = (torch.randn((1, heads, seq, d), generator=g, device=dev, dtype=torch.bfloat16) for _ in range(3))
            pre = sageattn3.preprocess(q, k, v)
            s = d ** -0.5
            t = [median_ms(lambda pv=pv, c=c: _kernels.qk_rule_select(q, k, v, pre, s, lim, False, pv, c))
                 for pv, c in ((pv_lim, False), (-1.0, False), (pv_lim, True))]
            t_pre = median_ms(lambda: sageattn3.preprocess(q, k, v))
            print(f"D {d} {heads} heads x {seq}: rule+P {t[0]:.3f} ms, rule only {t[1]:.3f} ms, causal {t[2]:.3f} ms, "
                  f"preprocess {t_pre:.3f} ms", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
