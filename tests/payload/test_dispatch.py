"""Dispatch of sageattn3_blackwell / blockscaled_fp4_attn on CPU, with the device capability and
the kernels mocked: which path each (GPU, build, environment) takes and what backend() says; the
FP4 wiring and the self-check's caching, skipping and fallback with a fake kernel (the
reference itself, or a deliberately wrong one)."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import sageattn3
from sageattn3 import _guard, _kernels, _selfcheck, api
from sageattn3 import reference as ref

from payload_data import qkv

CUDA0 = torch.device("cuda", 0)


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    monkeypatch.delenv(_kernels.FORCE_FP4_ENV, raising=False)
    monkeypatch.delenv(_selfcheck.SKIP_ENV, raising=False)
    api._warned.clear()
    _selfcheck.reset()
    yield
    api._warned.clear()
    _selfcheck.reset()


def gpu(monkeypatch, cc, *, model=False, runs=None, attn=True):
    """Pretend cuda:0 has capability ``cc`` and this wheel's kernels are loaded."""
    monkeypatch.setattr(_kernels, "device_cc", lambda device: cc)
    monkeypatch.setattr(_kernels, "kernels_run_on", lambda device: runs)
    monkeypatch.setattr(_kernels, "has_attention_kernel", lambda: attn)
    monkeypatch.setattr(_kernels, "mma_model_build", lambda: model)


# ---------------------------------------------------------------------------------------------
# Which path, and why
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cc,want", [((12, 0), "fp4-sm120"), ((12, 1), "fp4-sm121")])
@pytest.mark.parametrize("d", [64, 128, None])
def test_sm120_family_takes_fp4(monkeypatch, cc, want, d):
    gpu(monkeypatch, cc)
    assert str(api._attention_path(CUDA0, d)) == want
    assert sageattn3.backend(CUDA0, d) == f"{want} (self-check runs on the first call)"
    assert sageattn3.is_available(CUDA0)


@pytest.mark.parametrize("d", [32, 80, 96, 256])
def test_unsupported_head_dim_falls_back(monkeypatch, d):
    gpu(monkeypatch, (12, 0))
    assert str(api._attention_path(CUDA0, d)) == f"sdpa: head_dim {d} is not supported by the FP4 kernel (64/128)"


@pytest.mark.parametrize("cc", [(9, 0), (10, 0), (10, 3), (8, 9), (11, 0)])
def test_other_gpus_fall_back(monkeypatch, cc):
    gpu(monkeypatch, cc)
    want = f"sdpa: sm_{cc[0]}{cc[1]} has no FP4 MMA (the FP4 path needs sm_120/sm_121)"
    assert str(api._attention_path(CUDA0, 128)) == want
    assert sageattn3.backend(CUDA0) == want
    assert not sageattn3.is_available(CUDA0)


def test_force_needs_the_model_flavour(monkeypatch):
    gpu(monkeypatch, (9, 0), model=False)
    monkeypatch.setenv(_kernels.FORCE_FP4_ENV, "1")
    path = str(api._attention_path(CUDA0, 128))
    assert path.startswith("sdpa: sm_90 has no FP4 MMA") and "SAGEATTN3_FORCE_FP4=1 is ignored" in path
    assert "normal build" in path


@pytest.mark.parametrize("value,forced", [("1", True), ("0", False), ("", False), ("yes", False)])
def test_force_routes_sm90_through_the_model(monkeypatch, value, forced):
    gpu(monkeypatch, (9, 0), model=True)
    monkeypatch.setenv(_kernels.FORCE_FP4_ENV, value)
    path = str(api._attention_path(CUDA0, 64))
    assert (path == "fp4-model-sm90") is forced
    if forced:
        b = sageattn3.backend(CUDA0)
        assert b.startswith("fp4-model-sm90 (") and "software model" in b and "self-check" in b
        assert str(api._attention_path(CUDA0, 96)).startswith("sdpa: head_dim 96")
    else:
        assert path == "sdpa: sm_90 has no FP4 MMA (the FP4 path needs sm_120/sm_121)"


def test_the_path_is_a_value(monkeypatch):
    """The path's fields say what its string says; nothing parses the string."""
    gpu(monkeypatch, (12, 1))
    assert api._attention_path(CUDA0, 128) == api.AttentionPath("fp4", arch="sm121")
    gpu(monkeypatch, (9, 0), model=True)
    monkeypatch.setenv(_kernels.FORCE_FP4_ENV, "1")
    forced = api._attention_path(CUDA0, 128)
    assert forced.is_fp4 and forced.model and forced.arch == "sm90" and forced.reason == ""
    cpu = api._attention_path(torch.device("cpu"), 128)
    assert (cpu.kind, cpu.reason, cpu.is_fp4) == ("sdpa", "CPU tensors", False)
    assert str(api.AttentionPath.sdpa("why")) == "sdpa: why"


def test_model_flavour_without_force_keeps_sdpa(monkeypatch):
    gpu(monkeypatch, (9, 0), model=True)
    assert str(api._attention_path(CUDA0, 128)) == "sdpa: sm_90 has no FP4 MMA (the FP4 path needs sm_120/sm_121)"


def test_model_flavour_on_sm120_says_so(monkeypatch):
    gpu(monkeypatch, (12, 0), model=True)
    b = sageattn3.backend(CUDA0)
    assert b.startswith("fp4-sm120 (MMA-model test flavour")


def test_kernels_that_cannot_run(monkeypatch):
    gpu(monkeypatch, (12, 0), runs="this build has no code for sm_120 (built for sm_90a)")
    assert str(api._attention_path(CUDA0, 128)) == "sdpa: this build has no code for sm_120 (built for sm_90a)"
    gpu(monkeypatch, (9, 0), model=True, runs="this build has no code for sm_90 (built for sm_120a)")
    monkeypatch.setenv(_kernels.FORCE_FP4_ENV, "1")
    assert str(api._attention_path(CUDA0, 128)) == "sdpa: this build has no code for sm_90 (built for sm_120a)"


def test_no_attention_kernel(monkeypatch):
    gpu(monkeypatch, (12, 0), attn=False)
    assert str(api._attention_path(CUDA0, 128)).startswith("sdpa: the FP4 attention kernel is not in this build")


def test_cpu_and_other_devices():
    assert str(api._attention_path(torch.device("cpu"), 128)) == "sdpa: CPU tensors"
    assert str(api._attention_path(torch.device("meta"), 128)) == "sdpa: meta tensors"


def test_failed_self_check_is_remembered_per_device(monkeypatch):
    gpu(monkeypatch, (12, 0))
    bad = _selfcheck.Result(ok=False, device="cuda:0", error="RuntimeError: boom")
    _selfcheck._results["cuda:0"] = bad
    path = str(api._attention_path(CUDA0, 128))
    assert path == "sdpa: the FP4 self-check failed on cuda:0: the kernel raised RuntimeError: boom"
    assert str(api._attention_path(torch.device("cuda", 1), 128)) == "fp4-sm120"
    _selfcheck._results["cuda:1"] = _selfcheck.Result(ok=True, device="cuda:1", figures=[{"cos": 0.99999}], gpu_ms=0.05)
    assert sageattn3.backend(torch.device("cuda", 1)) == "fp4-sm120 (self-check passed: worst cos-sim 0.999990, GPU span 50 us)"
    monkeypatch.setenv(_selfcheck.SKIP_ENV, "1")
    assert sageattn3.backend(torch.device("cuda", 2)) == "fp4-sm120 (self-check skipped (SAGEATTN3_SKIP_SELFCHECK=1))"


@pytest.mark.parametrize("record,want", [
    ({}, False),
    ({"mma_model": False, "extra": {"mma_model": False}}, False),
    ({"mma_model": True}, True),  # standalone `pip wheel` build record
    ({"extra": {"torch_lines": ["2.14"], "mma_model": True}}, True),  # the factory's record
])
def test_mma_model_build_reads_the_record(monkeypatch, record, want):
    monkeypatch.setattr(_guard, "build_record", lambda: record)
    assert _kernels.mma_model_build.__wrapped__() is want


# ---------------------------------------------------------------------------------------------
# The FP4 wiring and the self-check, with a fake kernel on CPU tensors
# ---------------------------------------------------------------------------------------------


def fake_path(device, head_dim=None):
    """The FP4 path for CPU tensors (as on sm_120), unless the self-check failed there."""
    failed = _selfcheck.failure(device)
    if failed is not None:
        return api.AttentionPath.sdpa(_selfcheck.fallback_reason(failed))
    if head_dim is not None and head_dim not in (64, 128):
        return api.AttentionPath.sdpa(f"head_dim {head_dim} is not supported by the FP4 kernel (64/128)")
    return api.AttentionPath.fp4((12, 0))


class Kernel:
    """A stand-in for the FP4 path: the reference algorithm, optionally corrupted."""

    def __init__(self, corrupt=None):
        self.corrupt = corrupt
        self.calls = []

    def __call__(self, q, k, v, is_causal, per_block_mean, sm_scale=None, qk_rotation=ref.QK_ROTATION_DEFAULT,
                 qk_balance=ref.QK_BALANCE_DEFAULT, qk_scale_search=False, qk_precision="fp4", choice=None,
                 pv_precision="fp4", pv_limit=None):
        self.calls.append((tuple(q.shape), tuple(k.shape), q.dtype, is_causal, per_block_mean))
        out = ref.sageattn3(q, k, v, is_causal=is_causal, per_block_mean=per_block_mean, sm_scale=sm_scale,
                            qk_rotation=qk_rotation, qk_balance=qk_balance, qk_scale_search=qk_scale_search,
                            qk_precision=qk_precision, pv_precision=pv_precision, pv_limit=pv_limit)
        if self.corrupt is not None:
            out = self.corrupt(q, k, v, is_causal, out)
        return out.to(q.dtype)


def wire(monkeypatch, kernel):
    monkeypatch.setattr(api, "_attention_path", fake_path)
    monkeypatch.setattr(api, "_fp4_attention", kernel)


def sdpa(q, k, v, causal):
    rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=causal)


def calls_with_warnings(fn, n=1):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        outs = [fn() for _ in range(n)]
    return outs, [str(x.message) for x in w if "sageattn3" in str(x.message)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_fp4_path_is_wired(monkeypatch, dtype, causal):
    kern = Kernel()
    wire(monkeypatch, kern)
    q, k, v = qkv(2, 4, 2, 77, 77, 64, dtype=dtype)
    copies = [t.clone() for t in (q, k, v)]
    (out, out2), msgs = calls_with_warnings(lambda: sageattn3.sageattn3_blackwell(q, k, v, is_causal=causal), 2)
    assert msgs == []
    assert out.dtype == dtype and out.shape == q.shape
    want = ref.sageattn3(q, k, v, is_causal=causal).to(dtype)
    assert torch.equal(out, want) and torch.equal(out2, want)
    for t, c in zip((q, k, v), copies):
        assert torch.equal(t, c)
    # the self-check ran once (its own calls: FP4 at D 128 and 64, FP8 Q·Kᵀ at D 128, FP8 Q·Kᵀ on
    # rotated rows at D 64, "auto" at D 64 and at D 128), then the two user calls
    assert _selfcheck.run_count == 1
    assert [c[0] for c in kern.calls] == [(1, 2, 256, 128), (1, 1, 256, 64), (1, 2, 256, 128), (1, 2, 256, 64),
                                          (1, 2, 256, 64), (1, 2, 256, 128), (2, 4, 77, 64), (2, 4, 77, 64)]
    r = _selfcheck.result(q.device)
    assert r.ok and [f["qk"] for f in r.figures] == ["fp4", "fp4", "fp8", "fp8", "auto", "auto"]
    assert [f["options"] for f in r.figures] == ["", "", "pv_precision='fp4'", "qk_rotation=True, qk_scale_search=True, pv_precision='fp4'", "pv_precision='fp4'", "pv_precision='fp4'"]
    assert all(f["cos"] > 0.99999 for f in r.figures)


def test_fp8_pv_has_its_own_check_on_first_use(monkeypatch):
    """pv_precision="fp8" runs the FP8 P·V check once per device on its first call (the default
    check never runs those kernels); every case reaches the kernel with the option."""
    kern = Kernel()
    wire(monkeypatch, kern)
    q, k, v = qkv(1, 2, 1, 70, 70, 128)
    sageattn3.sageattn3_blackwell(q, k, v)
    assert _selfcheck.run_count == 1 and "FP8 P·V" not in _selfcheck.describe(q.device)
    seen = []
    orig = Kernel.__call__

    def spy(self, *a, **kw):
        seen.append(kw.get("pv_precision", "fp4"))
        return orig(self, *a, **kw)

    monkeypatch.setattr(Kernel, "__call__", spy)
    (out, out2), msgs = calls_with_warnings(lambda: sageattn3.sageattn3_blackwell(q, k, v, pv_precision="fp8"), 2)
    assert msgs == [] and _selfcheck.run_count == 2
    assert seen == [c[8]["pv_precision"] for c in _selfcheck.PV8_CASES] + ["fp8"] * 2  # its cases, then the calls
    want = ref.sageattn3(q, k, v, pv_precision="fp8").bfloat16()
    assert torch.equal(out, want) and torch.equal(out2, want)
    assert "FP8 P·V self-check passed" in _selfcheck.describe(q.device)


def test_failed_fp8_pv_check_runs_fp4_pv_with_one_warning(monkeypatch):
    """An FP8 P·V kernel that fails its check: one loud warning, then pv_precision="fp8" calls on
    that device run NVFP4 P·V (the default path, whose own check passed), not SDPA."""
    kern = Kernel(corrupt=lambda q, k, v, c, out: out)
    wire(monkeypatch, kern)
    orig = Kernel.__call__

    def broken_pv8(self, q, k, v, *a, pv_precision="fp4", **kw):
        out = orig(self, q, k, v, *a, pv_precision=pv_precision, **kw)
        return out.flip(-1) if pv_precision == "fp8" else out

    monkeypatch.setattr(Kernel, "__call__", broken_pv8)
    q, k, v = qkv(1, 2, 1, 70, 70, 64)
    outs, msgs = calls_with_warnings(lambda: sageattn3.sageattn3_blackwell(q, k, v, pv_precision="fp8"), 3)
    assert len(msgs) == 1 and "FP8 P·V SELF-CHECK FAILED on cpu [pv8]" in msgs[0], msgs
    assert "runs NVFP4 P·V instead" in msgs[0] and "cos-sim" in msgs[0]
    want = ref.sageattn3(q, k, v).bfloat16()
    assert all(torch.equal(o, want) for o in outs)
    assert _selfcheck.failure(q.device) is None  # the default path stays the FP4 kernel
    assert "FP8 P·V self-check FAILED" in _selfcheck.describe(q.device)
    # the kernel itself, without fallback, refuses instead
    monkeypatch.setattr(_kernels, "has_attention_kernel", lambda: True)
    for name in ("blockscaled_attn_pv8", "blockscaled_attn_mixed"):
        monkeypatch.setattr(torch.ops.sageattn3, name, object(), raising=False)
    with pytest.raises(RuntimeError, match="FP8 P·V self-check failed on this device: D=128.*use pv_precision='fp4'"):
        sageattn3.blockscaled_fp4_attn(q, k, v, pv_precision="fp8")
    assert torch.equal(sageattn3.blockscaled_fp4_attn(q, k, v), want)


def test_blockscaled_fp4_attn_is_the_fp4_path(monkeypatch):
    kern = Kernel()
    wire(monkeypatch, kern)
    monkeypatch.setattr(_kernels, "has_attention_kernel", lambda: True)
    q, k, v = qkv(1, 2, 1, 40, 50, 128)
    out = sageattn3.blockscaled_fp4_attn(q, k, v, is_causal=False, per_block_mean=False, sm_scale=0.1)
    assert torch.equal(out, ref.sageattn3(q, k, v, per_block_mean=False, sm_scale=0.1).bfloat16())
    assert kern.calls[-1] == ((1, 2, 40, 128), (1, 1, 50, 128), torch.bfloat16, False, False)
    with pytest.raises(RuntimeError, match="head_dim 96"):
        sageattn3.blockscaled_fp4_attn(*qkv(1, 1, 1, 8, 8, 96))


def test_unsupported_head_dim_never_reaches_the_kernel(monkeypatch):
    kern = Kernel()
    wire(monkeypatch, kern)
    q, k, v = qkv(1, 2, 2, 20, 20, 96)
    (out,), msgs = calls_with_warnings(lambda: sageattn3.sageattn3_blackwell(q, k, v))
    assert kern.calls == [] and len(msgs) == 1 and "head_dim 96" in msgs[0]
    assert torch.allclose(out.float(), sdpa(q, k, v, False).float(), atol=1e-2)


def test_self_check_can_be_skipped(monkeypatch):
    kern = Kernel(corrupt=lambda q, k, v, c, out: -out)  # would fail the check
    wire(monkeypatch, kern)
    monkeypatch.setenv(_selfcheck.SKIP_ENV, "1")
    q, k, v = qkv(1, 1, 1, 30, 30, 64)
    (out,), msgs = calls_with_warnings(lambda: sageattn3.sageattn3_blackwell(q, k, v))
    assert msgs == [] and _selfcheck.run_count == 0 and len(kern.calls) == 1
    assert torch.equal(out, (-ref.sageattn3(q, k, v)).bfloat16())


def wrong_layout(q, k, v, causal, out):
    return out.flip(-1)  # e.g. a transposed fragment: right values, wrong places


def wrong_scale(q, k, v, causal, out):
    return out * 1.1  # e.g. a missed normalisation: cos-sim 1, the relative L2 error catches it


def skipped_quantization(q, k, v, causal, out):
    return ref.exact_attention(q, k, v, is_causal=causal)  # a different algorithm (no FP4)


def nan_output(q, k, v, causal, out):
    return out.masked_fill(torch.rand(out.shape, generator=torch.Generator().manual_seed(0)) < 0.01, float("nan"))


@pytest.mark.parametrize("corrupt", [wrong_layout, wrong_scale, skipped_quantization, nan_output])
def test_mismatch_warns_once_and_falls_back(monkeypatch, corrupt):
    kern = Kernel(corrupt=corrupt)
    wire(monkeypatch, kern)
    q, k, v = qkv(2, 4, 1, 65, 65, 128, dtype=torch.float16)
    copies = [t.clone() for t in (q, k, v)]
    outs, msgs = calls_with_warnings(lambda: sageattn3.sageattn3_blackwell(q, k, v, is_causal=True), 3)
    assert len(msgs) == 1, msgs
    assert "FP4 SELF-CHECK FAILED on cpu" in msgs[0] and "falls back to torch scaled_dot_product_attention" in msgs[0]
    if corrupt is not nan_output:
        assert "cos-sim" in msgs[0] and "max abs error" in msgs[0] and "rel L2" in msgs[0]
    want = sdpa(q, k, v, True)
    for out in outs:
        assert torch.equal(out, want)
    assert len(kern.calls) == len(_selfcheck.CASES)  # only the self-check's own calls
    assert _selfcheck.run_count == 1
    for t, c in zip((q, k, v), copies):
        assert torch.equal(t, c)
    assert str(fake_path(q.device)).startswith("sdpa: the FP4 self-check failed on cpu")
    monkeypatch.setattr(_kernels, "has_attention_kernel", lambda: True)
    with pytest.raises(RuntimeError, match="self-check failed"):
        sageattn3.blockscaled_fp4_attn(q, k, v)


def test_kernel_error_is_a_failed_check(monkeypatch):
    def boom(*a, **kw):
        raise RuntimeError("CUDA error: no kernel image is available for execution on the device")

    wire(monkeypatch, boom)
    q, k, v = qkv(1, 1, 1, 10, 10, 64)
    (out, _), msgs = calls_with_warnings(lambda: sageattn3.sageattn3_blackwell(q, k, v), 2)
    assert len(msgs) == 1 and "no kernel image" in msgs[0]
    assert torch.equal(out, sdpa(q, k, v, False))


def test_self_check_inputs_are_exact():
    """The check's premise: its inputs' sums and means are exact in float32 whatever the
    order, so kernel and reference quantize identical values."""
    for i, case in enumerate(_selfcheck.CASES):
        for t in _selfcheck._inputs(case, seed=20250 + i):
            x = t.double()
            # multiples of 1/8 up to 32 (the D 128 "auto" case's last Q head MASSIVE times that:
            # multiples of MASSIVE/8, so its sums are as exact)
            big = _selfcheck.MASSIVE if case[7] == "auto" and case[4] == 128 else 1
            assert torch.equal((x * 8).round(), x * 8) and x.abs().max() <= 32 * big
            s32 = t.float().sum(dim=-2)
            s32_rev = t.float().flip(-2).cumsum(dim=-2)[..., -1, :]
            assert torch.equal(s32.double(), x.sum(dim=-2)) and torch.equal(s32, s32_rev)


def test_self_check_auto_case_at_d128_takes_the_raw_rows():
    """The D 128 "auto" cases' inputs (the default group's and FP8 P·V's): the rule keeps head 0
    in FP4 and gives head 1 the raw 16-bit rows, by a margin (estimates about 0.05-0.06 and 0.5-0.6 against
    0.2, qk16_stat 1.4 and 45 against 15), so the check runs those kernels."""
    for group in (_selfcheck.CASES, _selfcheck.PV8_CASES):
        i, case = next((i, c) for i, c in enumerate(group) if c[7] == "auto" and c[4] == 128)
        pre = ref.preprocess(*_selfcheck._inputs(case, seed=20250 + i), qk_precision="auto")
        assert pre.qk_fp8.flatten().tolist() == [False, True] and pre.qk16.flatten().tolist() == [False, True]
        err, stat = pre.qk_error.flatten(), pre.qk16_stat.flatten()
        assert float(err[0]) < ref.AUTO_ERROR_LIMIT - 0.1 and float(err[1]) > ref.AUTO_ERROR_LIMIT + 0.2, err
        assert float(stat[1]) > 2 * ref.QK16_STAT_LIMIT, stat


def test_self_check_auto_case_splits_the_heads():
    """The "auto" case's inputs: the rule keeps head 0 in FP4 and gives head 1 the 16-bit Q·Kᵀ, by
    a margin (estimates about 0.06 and 0.29 against the limit 0.2), so the check runs the per-head
    launches of a default call at D 64."""
    i = next(i for i, c in enumerate(_selfcheck.CASES) if c[7] == "auto")
    case = _selfcheck.CASES[i]
    assert case[4] == 64 and case[1] == 2
    pre = ref.preprocess(*_selfcheck._inputs(case, seed=20250 + i), qk_precision="auto")
    assert pre.qk_fp8.flatten().tolist() == [False, True]
    err = pre.qk_error.flatten()
    assert float(err[0]) < ref.AUTO_ERROR_LIMIT - 0.1 and float(err[1]) > ref.AUTO_ERROR_LIMIT + 0.05, err


def _variant_attention(variant):
    """The reference with one part of its correction broken, as a faulty kernel would have it:
    K's quantization residual dropped, the Q block residuals r ignored, or the other block's r."""
    import dataclasses
    import math

    def attention(q, k, v, is_causal, per_block_mean, qk_precision="fp4", **options):
        hq, sq, d = q.shape[1], q.shape[2], q.shape[3]
        pre = ref.preprocess(q, k, v, per_block_mean, pad=128)  # FP4 Q·Kᵀ whatever was asked: wrong for fp8 too
        if variant == "no_k_residual":
            pre = dataclasses.replace(pre, k_residual=torch.zeros_like(pre.k_residual))
        qd, kd, vd = ref._dequantized(pre, hq)
        delta = pre.delta_s
        if variant == "no_block_residual":
            delta = pre.delta_key.unsqueeze(-2).expand_as(delta)
        rows = ref.q_block_index(sq, delta.shape[-2])
        if variant == "other_block":
            rows = rows.flip(0)
        c = 1 / math.sqrt(d) * ref.LOG2E
        return ref._tiled_attention(qd, kd, vd, delta[..., rows, :], k.shape[-2], is_causal, c, 128).to(q.dtype)

    return attention


def test_self_check_runs_the_whole_correction():
    """The check's cases have two Q blocks whose means differ, so a kernel that got the block
    residuals' part of delta_s wrong (r_i · K̂ per key tile) fails it; the reference passes."""
    for i, case in enumerate(_selfcheck.CASES):  # the check's own inputs (run's seeds)
        pre = ref.preprocess(*_selfcheck._inputs(case, seed=20250 + i), True, pad=128)
        assert pre.mean_q.shape[-2] == 2 and pre.q_mean_residual.abs().amax() >= 1.0
        assert pre.k_residual is not None and pre.k_residual.float().abs().amax() > 0
    good = _selfcheck.run("cpu", lambda q, k, v, c, pbm, qk_precision, **o: ref.sageattn3(
        q, k, v, is_causal=c, per_block_mean=pbm, qk_precision=qk_precision, **o).to(q.dtype))
    assert good.ok and len(good.figures) == len(_selfcheck.CASES), good.summary()
    for variant in ("no_k_residual", "no_block_residual", "other_block"):
        bad = _selfcheck.run("cpu", _variant_attention(variant))
        assert not bad.ok, (variant, bad.figures)
        assert all(not _selfcheck._passes(f) for f in bad.figures), (variant, bad.figures)


def test_self_check_leaves_out_what_the_bounded_mode_never_runs(monkeypatch):
    """With SAGEATTN3_DELTA_S_WORKSPACE_MIB=0 no call can take FP8 Q·Kᵀ ("auto" stays FP4, "fp8"
    raises), so the check runs the FP4 cases only (not "auto"'s, whose reference leaves FP4 on one
    head), says so, and passes: a user who bounds the
    memory keeps the FP4 kernel. With the default workspace every case runs."""
    from sageattn3 import _attn

    calls = []

    def attention(q, k, v, c, pbm, qk_precision, **options):
        calls.append((qk_precision, options.get("pv_precision", "fp4")))
        if "fp8" in calls[-1] and _attn.delta_s_workspace_limit() == 0:
            raise ValueError("the FP8 kernels need the delta_s workspace")
        return ref.sageattn3(q, k, v, is_causal=c, per_block_mean=pbm, qk_precision=qk_precision, **options).to(q.dtype)

    monkeypatch.setenv(_attn.WORKSPACE_ENV, "0")
    r = _selfcheck.run("cpu", attention)
    assert r.ok and calls == [("fp4", "fp4")] * 2 and len(r.figures) == 2, r.summary()
    assert len(r.left_out) == 4 and all(_attn.WORKSPACE_ENV in x for x in r.left_out)
    assert ["fp8" in x for x in r.left_out] == [True, True, False, False]
    assert all("auto Q·Kᵀ" in x for x in r.left_out[2:])
    calls.clear()
    r = _selfcheck.run("cpu", attention, _selfcheck.PV8_CASES)  # FP8 P·V reads delta_s rows too
    assert r.ok and calls == [] and not r.figures and len(r.left_out) == len(_selfcheck.PV8_CASES)
    assert "with FP8 P·V" in r.left_out[0]
    monkeypatch.setenv(_attn.WORKSPACE_ENV, "1")  # 1 MiB holds the check's rows
    calls.clear()
    r = _selfcheck.run("cpu", attention)
    assert r.ok and [c[0] for c in calls] == [c[7] for c in _selfcheck.CASES] and r.left_out == []
    monkeypatch.setenv(_attn.WORKSPACE_ENV, "lots")  # malformed: the case runs and its call names the variable
    assert _selfcheck._runnable(_selfcheck.CASES[2], _selfcheck.Result(ok=True, device="cpu"))


def test_self_check_thresholds():
    ok = {"finite": True, "cos": 0.9995, "rel_l2": 0.03}
    assert _selfcheck._passes(ok)
    assert not _selfcheck._passes({**ok, "cos": 0.998})
    assert not _selfcheck._passes({**ok, "rel_l2": 0.06})
    assert not _selfcheck._passes({**ok, "finite": False})


def test_the_fp8_pv_self_check_runs_every_fp8_pv_kernel():
    """Each FP8 P·V kernel a call can take (D 64 and 128; FP4 Q·Kᵀ, or the precise one: MXFP8 at
    D 128, 16-bit at D 64) has a self-check case that runs it on every head, whatever the rule
    would estimate."""
    every_head = {(c[4], c[7]) for c in _selfcheck.PV8_CASES if c[8].get("pv_precision") == "fp8"}
    assert every_head >= {(64, "fp4"), (64, "fp8"), (128, "fp4"), (128, "fp8")}, every_head
