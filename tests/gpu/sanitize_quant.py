"""A small, script-friendly run of every quantization/preprocessing kernel over awkward shapes,
for compute-sanitizer:

    compute-sanitizer --tool memcheck --error-exitcode 1 python tests/gpu/sanitize_quant.py

Exits 0 when every kernel ran and matched the reference, 2 without CUDA or kernels."""

import sys

import torch


def main() -> int:
    if not torch.cuda.is_available():
        print("sanitize_quant: no CUDA device, nothing to run")
        return 2
    import sageattn3
    from sageattn3 import _kernels
    from sageattn3 import reference as ref

    why = _kernels.kernels_run_on(torch.device("cuda"))
    if why:
        print(f"sanitize_quant: kernels cannot run here: {why}")
        return 2
    bad = 0
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for shape in [(1, 1, 1, 16), (1, 2, 17, 64), (2, 1, 129, 128), (1, 3, 33, 48), (1, 1, 5, 256)]:
            x = torch.randn(shape, dtype=dtype, device="cuda")
            for fn, rf in ((sageattn3.scale_and_quant_fp4, ref.quantize_rows),
                           (sageattn3.scale_and_quant_fp4_transpose, ref.quantize_transposed)):
                p, s = fn(x)
                rp, rs = rf(x.cpu())
                ok = torch.equal(p.cpu(), rp) and torch.equal(s.view(torch.uint8).cpu(), rs.view(torch.uint8))
                bad += not ok
                print(f"{fn.__name__:32s} {str(dtype):15s} {shape}: {'ok' if ok else 'MISMATCH'}")
    for dtype in (torch.bfloat16, torch.float16):
        for (b, hq, hk, sq, sk, d) in [(1, 2, 1, 1, 1, 64), (1, 2, 2, 130, 17, 128), (1, 4, 2, 257, 300, 48)]:
            for pbm in (True, False):
                q = torch.randn(b, hq, sq, d, dtype=dtype, device="cuda")
                k = torch.randn(b, hk, sk, d, dtype=dtype, device="cuda")
                v = torch.randn(b, hk, sk, d, dtype=dtype, device="cuda")
                pre = sageattn3.preprocess(q, k, v, per_block_mean=pbm)
                want = ref.preprocess(q.cpu(), k.cpu(), v.cpu(), pbm, mean_q=pre.mean_q.cpu(), mean_k=pre.mean_k.cpu())
                ok = all(torch.equal(getattr(pre, n).view(torch.uint8).cpu(), getattr(want, n).view(torch.uint8))
                         for n in ("q_packed", "q_scales", "k_packed", "k_scales", "v_packed", "v_scales"))
                # V's tile exponents: at head dims that are multiples of 32 (the reference's too)
                ok = ok and (pre.v_exp is None) == (want.v_exp is None) == (d % 32 != 0)
                ok = ok and (pre.v_exp is None or torch.equal(pre.v_exp.cpu(), want.v_exp))
                bad += not ok
                print(f"preprocess {str(dtype):15s} {(b, hq, hk, sq, sk, d)} pbm={pbm}: {'ok' if ok else 'MISMATCH'}")
    for dtype in (torch.bfloat16, torch.float32):
        for (g, s, d) in [(1, 1, 16), (6, 1000, 64), (3, 3000, 256)]:
            x = torch.randn(g, s, d, dtype=dtype, device="cuda") + 2
            packed, scales, mean = _kernels.smooth_quant_seq(x, 128)
            sp = packed.shape[1]
            smoothed = torch.zeros(g, sp, d)
            smoothed[:, :s] = x.cpu().float() - mean.cpu()
            rp, rs = ref.quantize_rows(smoothed)
            ok = torch.allclose(mean.cpu(), ref.sample_mean(x.cpu()), rtol=1e-5, atol=1e-5)
            ok = ok and torch.equal(packed.cpu(), rp) and torch.equal(scales.view(torch.uint8).cpu(), rs.view(torch.uint8))
            bad += not ok
            print(f"smooth_quant_seq {str(dtype):15s} {(g, s, d)}: {'ok' if ok else 'MISMATCH'}")
    for dtype in (torch.bfloat16, torch.float16):
        for (gq, sq, gk, sk, d) in [(2, 1, 1, 1, 64), (3, 300, 1, 1000, 128), (4, 257, 2, 130, 48)]:
            q = torch.randn(gq, sq, d, dtype=dtype, device="cuda") + 1
            k = torch.randn(gk, sk, d, dtype=dtype, device="cuda") - 1
            qp, qsc, mq, kp, ksc, mk = _kernels.smooth_quant_qk(q, k, 128)
            mq2 = torch.empty_like(mq)
            qp2, qsc2 = _kernels.smooth_quant_rows(q, mq2, True, 128, 128)
            kp2, ksc2, mk2 = _kernels.smooth_quant_seq(k, 128)
            ok = torch.equal(mq, mq2) and torch.equal(mk, mk2) and torch.equal(qp, qp2) and torch.equal(kp, kp2)
            ok = ok and torch.equal(qsc.view(torch.uint8), qsc2.view(torch.uint8))
            ok = ok and torch.equal(ksc.view(torch.uint8), ksc2.view(torch.uint8))
            bad += not ok
            print(f"smooth_quant_qk {str(dtype):15s} {(gq, sq, gk, sk, d)}: {'ok' if ok else 'MISMATCH'}")
    bad += _rule_kernel()
    bad += _mxfp8_kernels()
    bad += _v_mxfp8()
    torch.cuda.synchronize()
    print("sanitize_quant:", "all ok" if not bad else f"{bad} mismatches")
    return 1 if bad else 0


def _on_cpu(pre):
    """A copy of a Preprocessed with every tensor on the CPU (the reference's inputs)."""
    import dataclasses

    return dataclasses.replace(pre, **{f.name: getattr(pre, f.name).cpu() for f in dataclasses.fields(pre)
                                       if isinstance(getattr(pre, f.name), torch.Tensor)})


def _rule_kernel() -> int:
    """The "auto" rule (qk_rule_select: Q·Kᵀ's estimate, the floor's with an option and P's in one
    launch; the third reads every 2nd row, 32 row groups a head; the fourth has one head of 8 row
    groups; the fifth reads every row, 24 row groups of 16) on ragged shapes,
    plain, rotated, balanced and with the scale search, against the reference's estimates (rel
    1e-3; P's 2e-3)."""
    import sageattn3
    from sageattn3 import _kernels
    from sageattn3 import reference as ref

    bad = 0
    torch.manual_seed(11)  # the same inputs on every run
    for dtype in (torch.bfloat16, torch.float16):
        for (b, hq, hk, sq, sk, d) in [(1, 2, 1, 1, 1, 64), (1, 4, 2, 130, 17, 128), (2, 2, 1, 1100, 300, 64),
                                       (1, 1, 1, 1100, 1030, 128), (1, 1, 1, 300, 300, 64)]:
            for kw in ({}, {"qk_rotation": True}, {"qk_balance": True, "qk_rotation": True, "qk_scale_search": True}):
                q = torch.randn(b, hq, sq, d, dtype=dtype, device="cuda") * 3
                k = torch.randn(b, hk, sk, d, dtype=dtype, device="cuda") + 1
                v = torch.randn(b, hk, sk, d, dtype=dtype, device="cuda")
                pre = sageattn3.preprocess(q, k, v, **kw)
                causal = sq > 1  # P's estimate with the causal mask but on the one-row shape
                err, sel_q, sel_k, err_pv, sel_v, _ = _kernels.qk_rule_select(q, k, v, pre, d ** -0.5, ref.AUTO_ERROR_LIMIT,
                                                                          False, ref.PV_ERROR_LIMIT, causal)
                cpu = _on_cpu(pre)
                want = ref.qk_fp4_error(q.cpu(), k.cpu(), v.cpu(), cpu)
                rel = ((err.cpu() - want).abs() / want.abs().clamp_min(1e-12)).max().item()
                ok = rel < 1e-3
                ok = ok and torch.equal((sel_q.cpu() & 1).bool(), err.cpu() > ref.AUTO_ERROR_LIMIT)
                want_pv = ref.pv_p_error(q.cpu(), k.cpu(), v.cpu(), cpu, is_causal=causal)
                rel_pv = ((err_pv.cpu() - want_pv).abs() / want_pv.abs().clamp_min(1e-12)).max().item()
                ok = ok and rel_pv < 2e-3
                ok = ok and torch.equal(((sel_q.cpu() >> 1) & 1).bool(), err_pv.cpu() > ref.PV_ERROR_LIMIT)
                bad += not ok
                print(f"qk_rule_select {str(dtype):15s} {(b, hq, hk, sq, sk, d)} {sorted(kw)} causal={causal}: "
                      f"{'ok' if ok else 'MISMATCH'} (rel {rel:.1e}, P's {rel_pv:.1e})")
    return bad


def _mxfp8_kernels() -> int:
    """The FP8 Q·Kᵀ operands (mxfp8_smooth_quant_qk: rows rotated as the preprocessing did, or
    rotated there with the means) on ragged shapes, some heads skipped, against the reference's
    q8/k8 on the kernels' means (bit for bit on the selected heads)."""
    import sageattn3
    from sageattn3 import _kernels
    from sageattn3 import reference as ref

    bad = 0
    for dtype in (torch.bfloat16, torch.float16):
        for (b, hq, hk, sq, sk, d) in [(1, 2, 1, 1, 1, 64), (1, 4, 2, 130, 17, 128), (2, 2, 1, 1100, 300, 64),
                                       (1, 1, 1, 1100, 1030, 128)]:
            for kw in ({}, {"qk_rotation": True}, {"qk_balance": True}):
                q = torch.randn(b, hq, sq, d, dtype=dtype, device="cuda") * 3
                k = torch.randn(b, hk, sk, d, dtype=dtype, device="cuda") + 1
                v = torch.randn(b, hk, sk, d, dtype=dtype, device="cuda")
                pre = sageattn3.preprocess(q, k, v, **kw)
                sel_q = (torch.arange(b * hq, device="cuda").view(b, hq) % 2 == 0).to(torch.uint8)
                sel_k = torch.ones((b, hk), dtype=torch.uint8, device="cuda")
                q8, q8s, k8, k8s = _kernels.mxfp8_smooth_quant_qk(q, k, pre, sel_q, sel_k, 128)
                cpu = _on_cpu(pre)
                want = ref.preprocess(q.cpu(), k.cpu(), v.cpu(), qk_precision="fp8", mean_q=cpu.mean_q,
                                      mean_k=cpu.mean_k, mean_q_global=cpu.mean_q_global, balance=cpu.balance, **kw)
                sel = sel_q.bool().cpu()
                if d == 64:  # the 16-bit Q·Kᵀ rows (bf16 bytes, no scales)
                    ok = q8s.numel() == 0 and k8s.numel() == 0 and want.q8_scales is None
                    ok = ok and torch.equal(q8.cpu()[sel], want.q8.view(torch.uint8)[sel])
                    ok = ok and torch.equal(k8.cpu(), want.k8.view(torch.uint8))
                else:
                    ok = torch.equal(q8.cpu()[sel], want.q8.view(torch.uint8)[sel]) and torch.equal(
                        q8s.cpu()[sel], want.q8_scales[sel])
                    ok = ok and torch.equal(k8.cpu(), want.k8.view(torch.uint8)) and torch.equal(k8s.cpu(), want.k8_scales)
                bad += not ok
                print(f"mxfp8_smooth_quant_qk {str(dtype):15s} {(b, hq, hk, sq, sk, d)} {sorted(kw)}: "
                      f"{'ok' if ok else 'MISMATCH'}")
    return bad


def _v_mxfp8() -> int:
    """V's MXFP8 quantizer of the FP8 P·V path (quant_mxfp8_cols) on ragged shapes and key
    paddings, against reference.quantize_mxfp8_transposed of V padded with zero keys (bit for bit)."""
    from sageattn3 import _pv8
    from sageattn3 import reference as ref

    bad = 0
    for dtype in (torch.bfloat16, torch.float16):
        for shape, pad in [((1, 1, 1, 64), 128), ((2, 3, 77, 80), 32), ((1, 2, 300, 128), 128), ((3, 1, 129, 16), 64)]:
            v = torch.randn(shape, dtype=dtype, device="cuda") * 5
            codes, scales = _pv8.quant_mxfp8_cols(v, pad)
            wc, ws = ref.quantize_mxfp8_transposed(ref.pad_dim(v.float().cpu(), -2, pad))
            ok = torch.equal(codes.view(torch.uint8).cpu(), wc.view(torch.uint8)) and torch.equal(scales.cpu(), ws)
            bad += not ok
            print(f"quant_mxfp8_cols {str(dtype):15s} {shape} pad {pad}: {'ok' if ok else 'MISMATCH'}")
    return bad


if __name__ == "__main__":
    sys.exit(main())
