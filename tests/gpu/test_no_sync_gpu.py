"""A call of ``sageattn3_blackwell`` never waits for the GPU, whatever its Q·Kᵀ precision.

Two checks per case, after a warm-up call (the first call on a device runs the self-check,
which waits by design):
- torch's own synchronisation points raise under ``torch.cuda.set_sync_debug_mode("error")``
  (a host read of a device value, ``.item()``, ``nonzero``, a copy to pageable memory);
- a wait that torch does not see (a ``cudaStreamSynchronize`` or a blocking copy in the
  extension, a ``cudaFree``): the GPU is kept busy for about half a second by
  ``torch.cuda._sleep`` before the call, and the call must return long before that work ends.
"""

from __future__ import annotations

import time

import pytest
import torch

from test_dispatch_fp4 import fp4  # noqa: F401  (the fixture)

PRECISIONS = ("fp4", "auto", "fp8")
BUSY_S = 0.5


def _busy_cycles(seconds: float) -> int:
    """GPU clock cycles that keep one ``torch.cuda._sleep`` busy for about ``seconds``."""
    torch.cuda.synchronize()
    probe = 50_000_000
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(probe)
    b.record()
    b.synchronize()
    return int(probe * seconds * 1e3 / max(a.elapsed_time(b), 1e-3))


def _inputs(seq: int, d: int, dtype: torch.dtype):
    g = torch.Generator(device="cuda").manual_seed(seq + d)
    return [torch.randn(1, 4, seq, d, dtype=dtype, device="cuda", generator=g) for _ in range(3)]


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("seq", [128, 1000, 4096])
@pytest.mark.parametrize("causal", [False, True])
def test_the_call_does_not_wait_for_the_gpu(fp4, precision, seq, causal):  # noqa: F811
    q, k, v = _inputs(seq, 128, torch.bfloat16)

    def call():
        return fp4.sageattn3_blackwell(q, k, v, is_causal=causal, qk_precision=precision)

    call()  # the self-check and the first-call set-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call()
    finally:
        torch.cuda.set_sync_debug_mode(0)

    cycles = _busy_cycles(BUSY_S)
    torch.cuda.synchronize()
    torch.cuda._sleep(cycles)  # the queue holds ~BUSY_S of work when the call starts
    t0 = time.perf_counter()
    out = call()
    host = time.perf_counter() - t0
    pending = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert pending, "the GPU finished its busy work before the call returned: the call waited for it"
    assert host < BUSY_S / 5, f"the call took {host * 1e3:.1f} ms on the host behind {BUSY_S} s of GPU work"
    assert out.shape == q.shape and torch.isfinite(out).all()


@pytest.mark.parametrize("precision", PRECISIONS)
def test_the_probe_sees_a_call_that_waits(fp4, precision):  # noqa: F811
    """The check above fails for a call that synchronises (here: one that reads a value back)."""
    q, k, v = _inputs(256, 64, torch.float16)

    def waits():
        out = fp4.sageattn3_blackwell(q, k, v, qk_precision=precision)
        out.sum().item()
        return out

    waits()
    cycles = _busy_cycles(BUSY_S)
    torch.cuda.synchronize()
    torch.cuda._sleep(cycles)
    t0 = time.perf_counter()
    waits()
    assert time.perf_counter() - t0 > BUSY_S / 2
    with pytest.raises(RuntimeError):
        torch.cuda.set_sync_debug_mode("error")
        try:
            waits()
        finally:
            torch.cuda.set_sync_debug_mode(0)
