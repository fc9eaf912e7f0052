"""Kernel benchmarks (plain script): python tests/bench/bench_kernels.py

1. NVFP4 quantization throughput as a % of the device's measured copy bandwidth, on tensors
   >= 256 MB (rows and transposed layouts, bf16 and fp16). Bandwidth counts bytes read + written.
2. Whole preprocessing of Q, K, V (batch 1, 24 heads, 32k tokens, D 128) against the time one
   bf16 read of Q, K, V plus the FP4 write would take at the measured copy bandwidth; shown
   for one call and per call over 10 back-to-back calls, with per-block Q means: the defaults;
   the scale search alone; the channel balance; the balance and the rotation, without and with
   the scale search; then with one Q mean. delta_s is not materialised (the attention kernel
   computes mean_q . K^T per tile); the bytes-moved bound adds the sampled blocks (up to 8 x 128 rows per head of Q and K, read a
   second time), the means and K's quantization residual (written with per-block means) to the floor. Then the stages alone: with per-block means Q and
   K are quantized in one launch after the two small launches of the sampled means ("Q and K
   smoothed + quant").
3. FP4 attention (batch 1, 16 heads, 4096 tokens, D 64/128, bf16, causal and not): the kernel on
   preprocessed inputs, the whole sageattn3_blackwell call (preprocessing included) and torch
   SDPA for comparison. On an H100 this needs the MMA-model test flavour (SAGEATTN3_FORCE_FP4=1 is
   set here for this section): the FP4 MMA is then a software model, so those times say nothing
   about sm_120 speed; they are printed, clearly labelled, to track the rest of the kernel.
   `--attention` runs this section alone.
4. Host overhead: the CPU time of one call (Python validation + dispatch + the kernel launches,
   measured from the call to its return, calls back to back) for
   sageattn3_blackwell on the FP4 path (batch 1, 24 heads, 1024 tokens, D 128; the MMA-model
   flavour on an H100) and for preprocess, with the parts of the FP4 call (the returned tensors
   are freed after the clock stops).
   Then, per Q·Kᵀ precision ("fp4", "auto", "fp8") and sequence length (128 to 4096 tokens;
   batch 1, 8 heads, D 128, bf16), the host time of one call made with an empty GPU queue (the
   CPU kept busy 2 ms before each call: see host_us_empty_queue) and of one made behind 20 ms
   of queued GPU work, beside torch SDPA's: the target is SDPA + 50 us at every length, flat in
   the length. (That no call waits for the GPU is a test: tests/gpu/test_no_sync_gpu.py.)
   `--host` runs this section alone, `--preprocess` sections 2 and 4.
Times are medians of CUDA-event-timed runs after warm-up."""

import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from sageattn3._diagnose import event_time_ms


def time_ms(fn, warmup=3, iters=10):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return statistics.median(event_time_ms(fn) for _ in range(iters))


def time_ms_batched(fn, calls=10, warmup=2, iters=5):
    """Per-call time of `calls` back-to-back calls between two events: the host enqueues ahead of
    the GPU, so Python/dispatch overhead (which time_ms includes, as the GPU waits for the launch
    after the first event) is hidden as long as it is shorter than the kernel."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / calls)
    return statistics.median(times)


def copy_bandwidth(nbytes):
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3)  # bytes/s, read + write


def main() -> int:
    if not torch.cuda.is_available():
        print("bench_kernels: no CUDA device, skipped")
        return 0
    import sageattn3
    from sageattn3 import _kernels

    dev = torch.device("cuda")
    why = _kernels.kernels_run_on(dev)
    if why:
        print(f"bench_kernels: kernels cannot run here ({why}), skipped")
        return 0
    print(f"device: {torch.cuda.get_device_name()}  sageattn3 {sageattn3.__version__}  torch {torch.__version__}")
    if "--attention" in sys.argv[1:]:
        return bench_attention()
    if "--host" in sys.argv[1:]:
        return bench_host()
    if "--preprocess" in sys.argv[1:]:  # section 2 (needs the copy bandwidth) and 4
        bench_preprocess(copy_bandwidth(1 << 30))
        return bench_host()
    bw = copy_bandwidth(1 << 30)
    print(f"device copy bandwidth (1 GiB, read+write): {bw / 1e9:.0f} GB/s")

    print("\n1. NVFP4 quantization (bytes = input read + packed + scales written)")
    for dtype in (torch.bfloat16, torch.float16):
        for shape in [(1, 24, 32768, 128), (8, 32, 8192, 64)]:
            x = torch.randn(shape, dtype=dtype, device="cuda")
            nin = x.numel() * x.element_size()
            nout = x.numel() // 2 + x.numel() // 16
            for name, fn in (("rows", sageattn3.scale_and_quant_fp4), ("transpose", sageattn3.scale_and_quant_fp4_transpose)):
                ms = time_ms(lambda: fn(x))
                msb = time_ms_batched(lambda: fn(x))
                rate, rateb = (nin + nout) / (ms * 1e-3), (nin + nout) / (msb * 1e-3)
                print(f"  {name:9s} {str(dtype)[6:]:9s} {str(shape):22s} {nin / 2**20:6.0f} MiB in  {ms:7.3f} ms  "
                      f"{rate / 1e9:6.0f} GB/s  {100 * rate / bw:5.1f}% of copy | back-to-back {msb:7.3f} ms "
                      f"{100 * rateb / bw:5.1f}%")
            del x

    bench_preprocess(bw)
    bench_host()
    return bench_attention()


def bench_preprocess(bw: float) -> None:
    from sageattn3 import _kernels
    import sageattn3

    print("\n2. preprocessing of Q, K, V: batch 1, 24 heads, 32768 tokens, D 128, bf16")
    shape = (1, 24, 32768, 128)
    q, k, v = (torch.randn(shape, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    n = q.numel()
    floor_bytes = 3 * 2 * n + 3 * (n // 2 + n // 16)  # one bf16 read of Q, K, V + the FP4 write
    floor_ms = floor_bytes / bw * 1e3
    print(f"  floor (one read of Q,K,V + FP4 write at copy bandwidth): {floor_ms:.3f} ms")
    for pbm, bal, rot, search in ((True, False, False, False), (True, False, False, True), (True, True, False, False),
                                  (True, True, True, False), (True, True, True, True), (False, False, False, False)):
        def call():
            return sageattn3.preprocess(q, k, v, per_block_mean=pbm, qk_balance=bal, qk_rotation=rot,
                                        qk_scale_search=search)
        ms = time_ms(call, warmup=2, iters=5)
        msb = time_ms_batched(call)
        pre = call()
        mq_mb = pre.mean_q.numel() * 4 / 1e6
        print(f"  per_block_mean={pbm!s:5s} qk_balance={bal!s:5s} qk_rotation={rot!s:5s} scale search {search!s:5s}: "
              f"{ms:.3f} ms = {ms / floor_ms:.2f}x the floor (mean_q {mq_mb:.1f} MB, no delta_s); "
              f"back-to-back {msb:.3f} ms = {msb / floor_ms:.2f}x")
        del pre
    # the stages on their own
    b, h, s, d = shape
    k3, q3 = k.view(b * h, s, d), q.view(b * h, s, d)
    mean_k = _kernels.smooth_quant_seq(k3, 128)[2]
    mean_q = torch.empty((b * h, s // 128, d), dtype=torch.float32, device="cuda")
    skp = s
    kp = torch.empty((b, h, skp, d // 2), dtype=torch.uint8, device="cuda")
    ksc = torch.empty((b, h, skp, d // 16), dtype=torch.float8_e4m3fn, device="cuda")
    ds = torch.empty((b, h, s // 128, skp), dtype=torch.float32, device="cuda")
    mk4, mq4 = mean_k.view(b, h, 1, d), mean_q.view(b, h, -1, d)
    stages = {
        "Q block means + quant": lambda: _kernels.smooth_quant_rows(q3, mean_q, True, 128, 128),
        "Q and K smoothed + quant": lambda: _kernels.smooth_quant_qk(q3, k3, 128),
        "  + delta_key (the default path)": lambda: _kernels.smooth_quant_qk_key(q3, k3, 128),
        "  + delta_key + scale search": lambda: _kernels.smooth_quant_qk_key(q3, k3, 128, search=True),
        "  + delta_key + channel balance": lambda: _kernels.smooth_quant_qk_key(q3, k3, 128, balance=True),
        "  channel balance exponents alone": lambda: _kernels.qk_balance(q3, k3),
        "  + delta_key + rotation": lambda: _kernels.smooth_quant_qk_key(q3, k3, 128, rotate=True),
        "K sampled mean + quant": lambda: _kernels.smooth_quant_seq(k3, 128),
        "K quant, mean given": lambda: _kernels.smooth_quant_rows(k3, mean_k, False, 0, 128),
        "V transposed quant": lambda: _kernels.quant_cols(v, 128),
        "(unused) K quant+delta_s MMA": lambda: torch.ops.sageattn3.smooth_quant_k_delta(k, mk4, mq4, kp, ksc, ds),
    }
    # every byte preprocessing moves besides the floor: the sampled blocks of Q and K (read a second
    # time, bf16), their column sums (written, read) and the means
    ns = min(8, -(-s // 128))
    sample_bytes = 2 * b * h * ns * 128 * d * 2 + 2 * 2 * b * h * ns * d * 4
    mean_bytes = mean_q.numel() * 4 + mean_k.numel() * 4
    res_bytes = 2 * k.numel()  # K's quantization residual, a float16 per element (per-block means)
    extra = sample_bytes + mean_bytes + res_bytes
    bound = (floor_bytes + extra) / bw * 1e3
    print(f"  bytes-moved bound with per-block means (floor + sampled blocks and means "
          f"{(sample_bytes + mean_bytes) / 1e6:.1f} MB + K's quantization residual {res_bytes / 1e6:.1f} MB): "
          f"{bound:.3f} ms = {bound / floor_ms:.2f}x the floor")
    for name, fn in stages.items():
        print(f"    {name:38s} {time_ms(fn, warmup=2, iters=5):7.3f} ms  back-to-back {time_ms_batched(fn):7.3f} ms")
    del q, k, v, k3, q3, kp, ksc, ds, stages


def host_us(fn, calls=30):
    """Median CPU time of one call in microseconds, over ``calls`` calls made back to back (each
    timed alone; the GPU runs behind, a few launches per call stay far from filling its queue).
    No synchronisation between calls: waiting for long GPU work lets the CPU clock down, and
    the next call's host time then grew with the GPU time of the last one (seen on the H100
    host: 325 us causal vs 540 us non-causal for the same Python)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
        del out  # outside the timed region; the next call reuses the memory (same stream)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def bench_host() -> int:
    import sageattn3
    from sageattn3 import _kernels, api

    print("\n4. host overhead per call (CPU time from the call to its return, calls back to back)")
    cc = torch.cuda.get_device_capability()
    if _kernels.mma_model_build() and cc not in _kernels.FP4_MMA_CCS:
        os.environ[_kernels.FORCE_FP4_ENV] = "1"
    b, h, s, d = 1, 24, 1024, 128  # host costs do not depend on the length; the GPU work does
    q, k, v = (torch.randn(b, h, s, d, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    path = sageattn3.backend()
    rows = [("preprocess (per_block_mean=True)", lambda: sageattn3.preprocess(q, k, v))]
    if path.startswith("fp4"):
        rows.append(("sageattn3_blackwell, FP4 path", lambda: sageattn3.sageattn3_blackwell(q, k, v)))
        if hasattr(api, "_preprocess_kernels"):
            pre = api._preprocess_kernels(q, k, v, True, 128, False)
            from sageattn3 import _attn

            rows += [
                ("  validation (_check_qkv)", lambda: api._check_qkv(q, k, v)),
                ("  preprocessing kernels, launched", lambda: api._preprocess_kernels(q, k, v, True, 128, False)),
                ("  attention kernel, launched", lambda: _attn.attention_from_preprocessed(
                    pre, out_dtype=q.dtype, trusted=True)),
                ("  one torch.empty (reference)", lambda: torch.empty((b, h, s, d // 2), dtype=torch.uint8,
                                                                      device="cuda")),
            ]
    else:
        print(f"  (FP4 path not taken here: {path})")
    rows.append(("torch SDPA (reference)", lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)))
    for name, fn in rows:
        print(f"  {name:40s} {host_us(fn):8.1f} us")
    del q, k, v
    if path.startswith("fp4"):
        bench_host_empty_queue()
    return 0


def _hot_cpu(seconds: float = 0.002) -> None:
    """Keeps this core busy for ``seconds`` (pure Python), with no CUDA call."""
    t = time.perf_counter()
    while time.perf_counter() - t < seconds:
        pass


def host_us_empty_queue(fn, calls=30):
    """Median and smallest CPU time of one call in microseconds, the GPU idle when each call starts: the wait for
    the previous call's work spins on ``Stream.query``, then the CPU spins 2 ms more without CUDA
    calls before the timed call. Without that second spin, the host work right after a long
    wait runs slower on these hosts, whatever it is: a profiler trace of the FP4 call on the H200
    after the 127 ms MMA-model kernel of the call before it (4096 tokens) showed every host step
    stretched (one 3 us allocation 37 us, one 5 us launch 71 us, decaying over about 0.5 ms) and
    no step that waits; the call's host time then grew with the length of the previous call's
    GPU work (100, 206, 509 us at 128, 1024, 4096 tokens), which SDPA's short kernels never
    show. The second spin gives every contender the same start."""
    return _host_us_after_idle(fn, calls, queued_cycles=0)


def host_us_behind_work(fn, calls=30):
    """Median and smallest CPU time of one call in microseconds with the GPU still busy (calls back to back
    behind 20 ms of queued work): what the host spends per call when it runs ahead of the GPU,
    as in a model's forward pass."""
    torch.cuda.synchronize()
    probe = 20_000_000
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(probe)
    b.record()
    b.synchronize()
    return _host_us_after_idle(fn, calls, queued_cycles=int(probe * 20.0 / max(a.elapsed_time(b), 1e-3)))


def _host_us_after_idle(fn, calls: int, queued_cycles: int) -> tuple[float, float]:
    """The median and the smallest host time of ``fn`` over ``calls`` calls, each made once the
    GPU finished the previous one (spinning on ``Stream.query``), after ``queued_cycles`` of
    ``torch.cuda._sleep`` (0: none) and 2 ms of busy CPU. The smallest is the steadier figure on a
    shared host: there the calling thread's CPU time tracks the wall time (measured on the H200
    host), so the spread is the host's speed varying, not the thread waiting."""
    for _ in range(3):
        fn()
    stream = torch.cuda.current_stream()
    times = []
    for _ in range(calls):
        while not stream.query():
            pass
        if queued_cycles:
            torch.cuda._sleep(queued_cycles)
        _hot_cpu()
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
        del out
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6, min(times) * 1e6


def bench_host_empty_queue() -> None:
    import sageattn3

    precisions = ("fp4", "auto", "fp8")
    for title, measure in (("empty GPU queue", host_us_empty_queue), ("behind 20 ms of queued GPU work",
                                                                       host_us_behind_work)):
        print(f"\n   host time of one call, {title} (batch 1, 8 heads, D 128, bf16; median of 30 / the "
              "smallest), and the excess over SDPA of each (target <= 50 us)")
        print(f"   {'tokens':>7s} {'SDPA':>13s} " + " ".join(f"{p:>13s} {'excess':>13s}" for p in precisions))
        worst: dict = {}
        for s in (128, 1024, 4096):
            q, k, v = (torch.randn(1, 8, s, 128, dtype=torch.bfloat16, device="cuda") for _ in range(3))
            base = measure(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
            cells = []
            for p in precisions:
                t = measure(lambda p=p: sageattn3.sageattn3_blackwell(q, k, v, qk_precision=p))
                ex = (t[0] - base[0], t[1] - base[1])
                worst[p] = tuple(max(a, b) for a, b in zip(worst.get(p, ex), ex))
                cells.append(f"{t[0]:6.1f}/{t[1]:6.1f} {ex[0]:+6.1f}/{ex[1]:+6.1f}")
            print(f"   {s:7d} {base[0]:6.1f}/{base[1]:6.1f} " + " ".join(cells))
            del q, k, v
        for i, what in enumerate(("medians", "smallest")):
            top = max(w[i] for w in worst.values())
            print(f"   worst excess over SDPA ({what}): " + ", ".join(f"{p} {w[i]:+.1f} us" for p, w in worst.items())
                  + ("  (within SDPA + 50 us)" if top <= 50 else "  (ABOVE SDPA + 50 us)"))


def bench_attention() -> int:
    import sageattn3
    from sageattn3 import _attn, _kernels

    print("\n3. FP4 attention: batch 1, 16 heads, 4096 tokens, bf16")
    cc = torch.cuda.get_device_capability()
    model = _kernels.mma_model_build()
    if model and cc not in _kernels.FP4_MMA_CCS:
        os.environ[_kernels.FORCE_FP4_ENV] = "1"  # the test flavour on an H100: route through the model
    path = sageattn3.backend()
    if not path.startswith("fp4"):
        print(f"  skipped: {path}")
        return 0
    if model:
        print("  *** MMA-MODEL TEST FLAVOUR: the FP4 MMA runs as a SOFTWARE MODEL on this GPU; these times are NOT")
        print("  *** representative of the real sm_120 kernel (reported only to track the rest of the kernel) ***")
    print(f"  path: {path}")
    b, h, s = 1, 16, 4096
    for d in (64, 128):
        q, k, v = (torch.randn(b, h, s, d, dtype=torch.bfloat16, device="cuda") for _ in range(3))
        pre = sageattn3.preprocess(q, k, v, pad=128)
        for causal in (False, True):
            flops = 4 * b * h * s * s * d / (2 if causal else 1)
            t_kernel = time_ms(lambda: _attn.attention_from_preprocessed(pre, is_causal=causal, out_dtype=q.dtype),
                               warmup=1, iters=5)
            t_call = time_ms(lambda: sageattn3.sageattn3_blackwell(q, k, v, is_causal=causal), warmup=1, iters=5)
            t_pre = time_ms(lambda: sageattn3.preprocess(q, k, v, pad=128), warmup=1, iters=5)
            t_sdpa = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), warmup=2, iters=10)
            print(f"  D={d:3d} causal={causal!s:5s}: kernel {t_kernel:8.3f} ms ({flops / t_kernel / 1e9:6.1f} TFLOP/s)  "
                  f"preprocess {t_pre:7.3f} ms  sageattn3_blackwell {t_call:8.3f} ms  | torch SDPA bf16 {t_sdpa:6.3f} ms "
                  f"({flops / t_sdpa / 1e9:6.1f} TFLOP/s)")
        del q, k, v, pre
    return 0


if __name__ == "__main__":
    sys.exit(main())
