"""The host path of one call (docs/performance.md, section 5), on the GPU at hand.

- The launch set-up is made once per device, not per call: after a first call, the ops make no
  runtime query (``cudaFuncSetAttribute``, the occupancy query, ``cudaDeviceGetAttribute``, ...)
  per call. Seen through torch's profiler, which records the process's CUDA runtime calls
  (CUPTI): a query made per call is one whose count grows with the calls profiled. The probe
  test checks that a query made per call from outside torch is seen so, so that a clean result
  is not the profiler's blindness.
- The ops that allocate their outputs (``preprocess_qkv``, ``qk_rule_select``,
  ``mxfp8_smooth_quant_qk``): each output has its fake's shape and dtype, is contiguous and
  16-byte aligned, has a storage of its own (outputs sharing one break torch's custom-op rule,
  which torch.compile checks), and stays valid (its bytes unchanged) after the others are gone
  and their memory could be handed out again.
- The Python around the ops makes q, k, v contiguous and aligned once per call (a strided q is
  copied once, not once per op) and reads ``SAGEATTN3_DELTA_S_WORKSPACE_MIB`` once per call.
"""

from __future__ import annotations

import ctypes
from collections import Counter

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from gpu_common import kernels_or_skip, same_bytes
from test_dispatch_fp4 import fp4  # noqa: F401  (the fixture)

# Runtime queries whose answers do not change between calls on one device.
QUERIES = ("cudaFuncSetAttribute", "cudaOccupancyMaxActiveBlocksPerMultiprocessor", "cudaDeviceGetAttribute",
           "cudaFuncGetAttributes", "cudaGetDeviceProperties")


def _runtime_calls(fn, calls: int) -> Counter:
    """How often each event name occurs in torch's profile of ``calls`` calls of ``fn``."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return Counter(e.name for e in prof.events())


def _per_call_queries(fn) -> tuple[dict[str, int], Counter]:
    """The runtime queries whose count grows with the number of calls of ``fn`` (profiles of 1 and
    of 4 calls: what the profiler itself asks once per profile cancels out), and the longer
    profile's events."""
    fn()  # the first call on the device: the self-check and the set-up, once
    one, four = _runtime_calls(fn, 1), _runtime_calls(fn, 4)
    grown = {n: four[n] - one[n] for n in four if any(q in n for q in QUERIES) and four[n] > one[n]}
    return grown, four


def _assert_no_queries(fn) -> None:
    grown, names = _per_call_queries(fn)
    assert any("cudaLaunch" in n for n in names), f"expected the calls' kernel launches in the profile, got {names}"
    assert grown == {}, f"expected no runtime query per call after the first, got these 3 calls more: {grown}"


def _qkv(seq: int, d: int = 128, heads: int = 4):
    g = torch.Generator(device="cuda").manual_seed(seq)
    return [torch.randn(1, heads, seq, d, dtype=torch.bfloat16, device="cuda", generator=g) for _ in range(3)]


@pytest.mark.parametrize("precision", ["fp4", "auto", "fp8"])
def test_a_strided_q_is_copied_once_and_the_limit_read_once(fp4, precision, monkeypatch):  # noqa: F811
    from sageattn3 import _attn

    q, k, v = _qkv(1000)  # 8 query blocks: the delta_s workspace is sized from the limit
    strided = q.transpose(1, 2).contiguous().transpose(1, 2)  # q's values, not contiguous
    reads = []
    read = _attn.delta_s_workspace_limit
    monkeypatch.setattr(_attn, "delta_s_workspace_limit", lambda: reads.append(1) or read())

    def call():
        return fp4.sageattn3_blackwell(strided, k, v, qk_precision=precision)

    call()  # the first call on the device: the self-check
    reads.clear()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        call()
    copies = [e.name for e in prof.events() if e.name == "aten::copy_"]
    assert len(copies) == 1, f"expected q copied once (made contiguous), got {len(copies)} copies"
    assert len(reads) == 1, f"expected the workspace limit read once per call, got {len(reads)} reads"


@pytest.mark.parametrize("precision", ["fp4", "auto", "fp8"])
@pytest.mark.parametrize("per_block_mean", [True, False])
def test_a_call_makes_no_runtime_query(fp4, precision, per_block_mean):  # noqa: F811
    """The attention (its shared-memory ceiling, occupancy and SM count), the rule (its shared-memory
    ceiling) and the preprocessing: set up on the first call only."""
    q, k, v = _qkv(300)
    _assert_no_queries(lambda: fp4.sageattn3_blackwell(q, k, v, per_block_mean=per_block_mean, qk_precision=precision))


def test_the_other_launchers_make_no_runtime_query():
    """NVFP4 along rows (its occupancy) and the fused K delta op (its shared-memory ceiling)."""
    sa = kernels_or_skip()
    q, k, v = _qkv(300, d=64)
    _assert_no_queries(lambda: sa.scale_and_quant_fp4(q))
    pre = sa.preprocess(q, k, v, per_block_mean=True)
    skp = pre.k_packed.shape[2]
    kp, ksc = torch.empty_like(pre.k_packed), torch.empty_like(pre.k_scales)
    ds = torch.empty((1, 4, pre.mean_q.shape[2], skp), dtype=torch.float32, device="cuda")
    _assert_no_queries(lambda: torch.ops.sageattn3.smooth_quant_k_delta(k, pre.mean_k, pre.mean_q, kp, ksc, ds))


def _loaded_cudart() -> ctypes.CDLL:
    """The CUDA runtime library this process loaded (torch's, which the extension links too)."""
    with open("/proc/self/maps") as f:
        paths = sorted({line.split()[-1] for line in f if "libcudart.so" in line})
    if not paths:
        pytest.skip("no shared libcudart in this process (a statically linked runtime): nothing to probe")
    return ctypes.CDLL(paths[0])


def test_the_probe_sees_a_runtime_query():
    """A cudaDeviceGetAttribute per call, made through the runtime library torch loaded, is seen
    by the check above: it would see a per-call query of the extension."""
    kernels_or_skip()
    cudart = _loaded_cudart()
    n = ctypes.c_int(0)
    grown, _ = _per_call_queries(lambda: cudart.cudaDeviceGetAttribute(ctypes.byref(n), 16, torch.cuda.current_device()))
    assert n.value > 0, f"expected the multiprocessor count, got {n.value}"
    assert grown == {"cudaDeviceGetAttribute": 3}, f"expected 3 more queries in 4 calls than in 1, got {grown}"


def _check_outputs(outs, fakes) -> None:
    """outs: an op's outputs; fakes: its fake's. Shapes, dtypes, contiguity, alignment, no overlap."""
    assert len(outs) == len(fakes), f"expected {len(fakes)} outputs, got {len(outs)}"
    for i, (t, f) in enumerate(zip(outs, fakes)):
        assert (t.shape, t.dtype) == (f.shape, f.dtype), f"output {i}: expected {f.shape} {f.dtype}, got {t.shape} {t.dtype}"
        assert t.is_contiguous(), f"output {i}: expected contiguous, got strides {t.stride()} for shape {t.shape}"
        assert t.numel() == 0 or t.data_ptr() % 16 == 0, f"output {i}: expected 16-byte aligned, got {t.data_ptr() % 16} past"
    # no two outputs share a storage: torch's custom-op rule (torch.compile checks it; csrc/torch/outputs.h)
    storages = [t.untyped_storage().data_ptr() for t in outs if t.numel()]
    assert len(set(storages)) == len(storages), f"outputs share a storage: {storages}"
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), i) for i, t in enumerate(outs) if t.numel())
    for (_, end, i), (start, _, j) in zip(spans, spans[1:]):
        assert end <= start, f"outputs {i} and {j} overlap: {i} ends at {end:#x}, {j} starts at {start:#x}"


def _each_survives_alone(make) -> None:
    """For each output of ``make()``: dropped all the others, then memory of their sizes taken and
    filled; the survivor's bytes must be what they were."""
    n = len(make())
    for keep in range(n):
        outs = list(make())
        survivor = outs[keep]
        want = survivor.clone()
        sizes = [t.numel() * t.element_size() for t in outs]
        del outs
        garbage = [torch.full((max(b, 1),), 0xA5, dtype=torch.uint8, device="cuda") for b in sizes + [sum(sizes)]]
        torch.cuda.synchronize()
        assert same_bytes(survivor, want), f"output {keep} changed once the other outputs were freed"
        del garbage


@pytest.mark.parametrize("per_block_mean,balance", [(True, False), (True, True), (False, False)])
@pytest.mark.parametrize("seq,d", [(300, 128), (1000, 64)])
def test_preprocess_outputs_are_separate_and_valid_alone(per_block_mean, balance, seq, d):
    kernels_or_skip()
    from sageattn3 import _kernels

    q, k, v = _qkv(seq, d)

    def make():
        return _kernels.preprocess_qkv(q, k, v, 128, per_block_mean, False, balance, False)

    _check_outputs(make(), _kernels._preprocess_qkv_fake(q, k, v, 128, per_block_mean, False, balance, False))
    _each_survives_alone(make)


@pytest.mark.parametrize("balance", [False, True])
def test_rule_and_mxfp8_outputs_are_separate_and_valid_alone(balance):
    sa = kernels_or_skip()
    from sageattn3 import _kernels

    q, k, v = _qkv(1000)
    if not _kernels.has_rule_kernel():
        pytest.skip("this wheel has no qk_rule kernel")
    pre = sa.preprocess(q, k, v, per_block_mean=True, qk_balance=balance)

    def rule():
        return _kernels.qk_rule_select(q, k, v, pre, 0.088, 0.1, True, 0.1)

    sel = rule()
    bal = _kernels._none(q.device, 8) if pre.balance is None else pre.balance
    _check_outputs(sel, _kernels._qk_rule_select_fake(q, k, v, pre.q_packed, pre.q_scales, pre.k_packed,
                                                      pre.k_scales, pre.v_packed, pre.v_scales, pre.v_exp, pre.mean_q,
                                                      pre.mean_k, bal, 0.088, False, False, 0.1,
                                                          True, 0.1))
    _each_survives_alone(rule)

    def mxfp8():
        return _kernels.mxfp8_smooth_quant_qk(q, k, pre, sel[1], sel[2], 128)

    _check_outputs(mxfp8(), _kernels._mxfp8_smooth_quant_qk_fake(q, k, pre.mean_q, pre.mean_k, bal, sel[1], sel[2],
                                                                  128, False))
    _each_survives_alone(mxfp8)
