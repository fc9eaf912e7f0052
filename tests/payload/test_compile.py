"""torch.compile on CPU: sageattn3_blackwell traces into one graph (0 graph breaks,
fullgraph=True) on the SDPA path and on the FP4 path (the custom op sageattn3::attention; the
FP4 kernel replaced by the reference, as in test_dispatch), compiled == eager; every op of the
C++ op table has a fake, and an op the table gains without one is reported."""

import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import sageattn3
from sageattn3 import _kernels, _selfcheck, api
from sageattn3 import reference as ref

from payload_data import qkv

ROOT = Path(__file__).resolve().parents[2]
OPS_H = ROOT / "sageattn3" / "csrc" / "torch" / "ops.h"


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.delenv(_kernels.FORCE_FP4_ENV, raising=False)
    monkeypatch.delenv(_selfcheck.SKIP_ENV, raising=False)
    torch._dynamo.reset()
    api._warned.clear()
    _selfcheck.reset()
    yield
    torch._dynamo.reset()
    api._warned.clear()
    _selfcheck.reset()


def explain(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch._dynamo.explain(fn)(*args, **kwargs)


@pytest.mark.parametrize("shape,causal", [((2, 4, 2, 37, 37, 64), True), ((1, 2, 2, 130, 70, 128), False)])
def test_sdpa_path_compiles_without_breaks(shape, causal):
    q, k, v = qkv(*shape)
    e = explain(sageattn3.sageattn3_blackwell, q, k, v, is_causal=causal)
    assert e.graph_break_count == 0, e.break_reasons
    assert e.graph_count == 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = torch.compile(sageattn3.sageattn3_blackwell, fullgraph=True)
        out = compiled(q, k, v, is_causal=causal)
        want = sageattn3.sageattn3_blackwell(q, k, v, is_causal=causal)
    assert torch.equal(out, want)


def test_compiled_sdpa_path_warns_once_at_compile_time():
    q, k, v = qkv(1, 2, 1, 16, 16, 64)
    compiled = torch.compile(sageattn3.sageattn3_blackwell, fullgraph=True)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        compiled(q, k, v)
        compiled(q, k, v)
    msgs = [str(x.message) for x in w if "sageattn3" in str(x.message)]
    assert msgs == ["sageattn3: falling back to torch scaled_dot_product_attention (CPU tensors)"]


def test_empty_and_invalid_inputs_under_compile():
    q, k, v = qkv(1, 2, 2, 0, 5, 64)
    out = torch.compile(sageattn3.sageattn3_blackwell, fullgraph=True)(q, k, v)
    assert out.shape == q.shape
    q, k, v = qkv(1, 3, 2, 8, 8, 64)
    with pytest.raises(Exception, match="multiple of k/v heads"):
        torch.compile(sageattn3.sageattn3_blackwell, fullgraph=True)(q, k, v)


class RefKernel:
    """The FP4 path's stand-in on CPU: the reference algorithm."""

    def __init__(self):
        self.calls = 0

    def __call__(self, q, k, v, is_causal, per_block_mean, sm_scale=None, qk_rotation=ref.QK_ROTATION_DEFAULT,
                 qk_balance=ref.QK_BALANCE_DEFAULT, qk_scale_search=False, qk_precision="fp4", choice=None,
                 pv_precision="fp4", pv_limit=None):
        self.calls += 1
        return ref.sageattn3(q, k, v, is_causal=is_causal, per_block_mean=per_block_mean,
                             qk_rotation=qk_rotation, qk_balance=qk_balance, qk_scale_search=qk_scale_search,
                             qk_precision=qk_precision, pv_precision=pv_precision, pv_limit=pv_limit).to(q.dtype)


def fp4_on_cpu(monkeypatch):
    """CPU tensors take the FP4 path (as on an sm_120 GPU) with the reference as its kernel."""
    kern = RefKernel()

    def path(device, head_dim=None):
        failed = _selfcheck.failure(device)
        if failed is not None:
            return api.AttentionPath.sdpa(_selfcheck.fallback_reason(failed))
        return api.AttentionPath.fp4((12, 0))

    monkeypatch.setattr(api, "_attention_path", path)
    monkeypatch.setattr(api, "_fp4_attention", kern)
    return kern


@pytest.mark.parametrize("causal", [False, True])
def test_fp4_path_compiles_to_one_custom_op(monkeypatch, causal):
    kern = fp4_on_cpu(monkeypatch)
    q, k, v = qkv(2, 4, 2, 77, 77, 64)
    e = explain(sageattn3.sageattn3_blackwell, q, k, v, is_causal=causal)
    assert e.graph_break_count == 0, e.break_reasons
    code = e.graphs[0].code
    assert "sageattn3.attention" in code and "scaled_dot_product_attention" not in code
    torch._dynamo.reset()
    _selfcheck.reset()
    compiled = torch.compile(sageattn3.sageattn3_blackwell, fullgraph=True)
    out = compiled(q, k, v, is_causal=causal)
    # the self-check (its calls) and the call itself ran inside the op, at run time: once under
    # explain() above, once more after the reset
    assert _selfcheck.run_count == 1 and kern.calls == 2 * (len(_selfcheck.CASES) + 1)
    eager = sageattn3.sageattn3_blackwell(q, k, v, is_causal=causal)
    assert torch.equal(out, eager)
    assert torch.equal(out, ref.sageattn3(q, k, v, is_causal=causal).to(q.dtype))
    assert out.is_contiguous() and out.shape == q.shape and out.dtype == q.dtype


def test_pv_precision_reaches_the_kernel_eager_and_compiled(monkeypatch):
    """pv_precision="fp8" travels to the FP4 path (here the reference: its FP8 P·V output), in eager
    calls and through the compiled custom op; a bad value is refused before anything runs."""
    fp4_on_cpu(monkeypatch)
    q, k, v = qkv(1, 4, 2, 77, 90, 64)
    want = ref.sageattn3(q, k, v, is_causal=True, pv_precision="fp8").to(q.dtype)
    assert torch.equal(sageattn3.sageattn3_blackwell(q, k, v, is_causal=True, pv_precision="fp8"), want)
    torch._dynamo.reset()
    compiled = torch.compile(sageattn3.sageattn3_blackwell, fullgraph=True)
    assert torch.equal(compiled(q, k, v, is_causal=True, pv_precision="fp8"), want)
    assert not torch.equal(want, ref.sageattn3(q, k, v, is_causal=True).to(q.dtype))
    with pytest.raises(ValueError, match="pv_precision must be one of"):
        sageattn3.sageattn3_blackwell(q, k, v, pv_precision="fp16")


def test_unsupported_head_dim_stays_sdpa_under_compile(monkeypatch):
    kern = fp4_on_cpu(monkeypatch)
    q, k, v = qkv(1, 2, 2, 20, 20, 96)
    e = explain(sageattn3.sageattn3_blackwell, q, k, v)
    assert e.graph_break_count == 0
    assert "scaled_dot_product_attention" in e.graphs[0].code and "sageattn3.attention" not in e.graphs[0].code
    assert kern.calls == 0  # neither the kernel nor the self-check ran


def test_failed_self_check_falls_back_inside_the_compiled_op(monkeypatch):
    kern = fp4_on_cpu(monkeypatch)
    monkeypatch.setattr(api, "_fp4_attention", lambda q, k, v, c, p, s=None, **kw: -kern(q, k, v, c, p, s, **kw))
    q, k, v = qkv(1, 2, 1, 40, 40, 128)
    compiled = torch.compile(sageattn3.sageattn3_blackwell, fullgraph=True)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = compiled(q, k, v, is_causal=True)
    assert any("FP4 SELF-CHECK FAILED" in str(x.message) for x in w)
    want = api._sdpa(q, k, v, True)
    assert torch.equal(out, want)


def test_the_constant_marker_is_dynamos():
    """api marks _compile_path / _kernels_serve the way torch._dynamo.assume_constant_result
    does, without importing torch._dynamo at import time: the decorator sets only that."""

    def f():
        return 1

    torch._dynamo.assume_constant_result(f)
    assert f.__dict__ == {"_dynamo_marked_constant": True}
    assert api._compile_path._dynamo_marked_constant is True
    assert api._kernels_serve._dynamo_marked_constant is True


# ---------------------------------------------------------------------------------------------
# Fakes for the C++ ops
# ---------------------------------------------------------------------------------------------


def cpp_op_table() -> dict[str, str]:
    """name -> schema, from the SAGEATTN3_OPS table both torch-facing units register."""
    text = OPS_H.read_text()
    m = re.search(r"#define SAGEATTN3_OPS\(X\)(.*?)\n\s*\n", text, re.S)
    assert m, f"no SAGEATTN3_OPS table in {OPS_H}"
    body = m.group(1).replace("\\\n", " ")
    table = {}
    for name, literals in re.findall(r"X\(\s*(\w+)\s*,((?:\s*\"[^\"]*\")+)\s*\)", body):
        table[name] = "".join(re.findall(r"\"([^\"]*)\"", literals))
    return table


def test_every_cpp_op_is_known_and_only_writes_outputs():
    """Every op of the C++ table is either output-writing (returns nothing: a trivial fake) or
    allocating (returns only new tensors, mutates nothing: a fake computing their shapes)."""
    table = cpp_op_table()
    assert len(table) >= 5
    assert not set(_kernels.OUTPUT_WRITING_OPS) & set(_kernels.ALLOCATING_OPS)
    assert set(table) == set(_kernels.OUTPUT_WRITING_OPS) | set(_kernels.ALLOCATING_OPS), (
        "the C++ op table and sageattn3._kernels.OUTPUT_WRITING_OPS/ALLOCATING_OPS differ: give a new op its fake there")
    for name, schema in table.items():
        assert schema.startswith(f"{name}("), schema
        if name in _kernels.OUTPUT_WRITING_OPS:
            assert schema.endswith("-> ()"), schema
            assert re.search(r"Tensor\(\w!\)", schema), f"{name} writes no output: a trivial fake is wrong for it"
        else:
            assert not schema.endswith("-> ()") and "!" not in schema, f"{name} must only return new tensors"


def test_fakes_cover_the_op_table_and_run_under_fake_tensors(tmp_path):
    """In a fresh process: the C++ table's schemas defined as the compiled library does,
    register_fakes() gives each a fake (an unknown op is reported), and every op runs on fake
    tensors (what torch.compile traces with)."""
    script = textwrap.dedent(f"""
        import re, sys, torch
        sys.path.insert(0, {str(ROOT / 'sageattn3')!r})
        schemas = {cpp_op_table()!r}
        lib = torch.library.Library("sageattn3", "FRAGMENT")
        for s in schemas.values():
            lib.define(s)
        lib.define("brand_new(Tensor x, Tensor(a!) out) -> ()")
        from sageattn3 import _kernels
        missing = _kernels.register_fakes()
        assert missing == ["brand_new"], missing
        assert _kernels.register_fakes() == ["brand_new"]  # idempotent
        from torch._subclasses.fake_tensor import FakeTensorMode
        with FakeTensorMode():
            for pbm, bal in ((True, True), (False, False)):
                q, kv = torch.empty(2, 6, 300, 64, dtype=torch.bfloat16), torch.empty(2, 3, 129, 64, dtype=torch.bfloat16)
                out = torch.ops.sageattn3.preprocess_qkv(q, kv, kv, 128, pbm, False, bal, False)
                got = [(tuple(t.shape), t.dtype) for t in out]
                u8, e4, f32 = torch.uint8, torch.float8_e4m3fn, torch.float32
                want = [((2, 6, 384, 32), u8), ((2, 6, 384, 4), e4), ((2, 3, 256, 32), u8), ((2, 3, 256, 4), e4),
                        ((2, 3, 64, 128), u8), ((2, 3, 64, 16), e4), ((2, 6, 3 if pbm else 1, 64), f32),
                        ((2, 3, 1, 64), f32), ((2 if pbm else 0, 6, 1, 64), f32), ((2, 6, 256), f32),
                        ((2 if bal else 0, 3, 1, 64), f32), ((2 if pbm else 0, 3, 256, 64), torch.float16), ((2, 3, 2, 2), u8)]
                assert got == want, got
                out = torch.ops.sageattn3.attention_call(q, kv, kv, False, pbm, False, bal, False, 1, 1, 0.125, 0.125,
                                                         False, 0.2, 0.1, -1.0, 0)
                assert (tuple(out.shape), out.dtype) == ((2, 6, 300, 64), torch.bfloat16), out
            for name, s in schemas.items():
                if name in _kernels.ALLOCATING_OPS:
                    continue
                args = []
                for typ in re.findall(r"(Tensor(?:\\(\\w!\\))?|bool|int|float) \\w+", s):
                    args.append(torch.empty(4, 16) if typ.startswith("Tensor") else
                                {{"bool": False, "int": 1, "float": 1.0}}[typ])
                assert getattr(torch.ops.sageattn3, name)(*args) is None, name
        print("ok", len(schemas))
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"ok {len(cpp_op_table())}" in res.stdout
