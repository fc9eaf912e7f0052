"""torch.compile and CUDA graphs on the GPU, against the installed wheel.

- every op the loaded library registers has a fake and runs on fake tensors;
- sageattn3_blackwell under torch.compile(fullgraph=True): 0 graph breaks, compiled == eager
  bit for bit, on the FP4 path (sm_120/121, or the MMA-model flavour with SAGEATTN3_FORCE_FP4=1
  on an H100) and on the SDPA path; the quantizers and preprocess compile too;
- a CUDA graph captured around sageattn3_blackwell replays equal to eager, also after new
  inputs are copied into the captured tensors."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

from attn_common import make_qkv
from gpu_common import FP4_CCS, fp4_path_or_skip, sageattn3_or_skip



def _reset():
    from sageattn3 import _selfcheck, api

    torch._dynamo.reset()
    api._warned.clear()
    _selfcheck.reset()


@pytest.fixture
def fp4(monkeypatch):
    sa = fp4_path_or_skip(monkeypatch)
    _reset()
    yield sa
    _reset()


def explain(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch._dynamo.explain(fn)(*args, **kwargs)


def test_every_loaded_op_has_a_fake():
    sageattn3_or_skip()
    from sageattn3 import _kernels

    if not _kernels.loaded():
        pytest.skip(f"extension not loaded: {_kernels.NOT_LOADED_REASON}")
    ops = _kernels.library_ops()
    assert _kernels.register_fakes() == [], "ops without a fake"
    assert set(ops) == set(_kernels.OUTPUT_WRITING_OPS) | set(_kernels.ALLOCATING_OPS) | set(_kernels.PYTHON_OPS), ops
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        for name in _kernels.OUTPUT_WRITING_OPS:
            op = getattr(torch.ops.sageattn3, name).default
            args = []
            for a in op._schema.arguments:
                t = str(a.type)
                args.append(torch.empty(4, 16, device="cuda") if t.startswith("Tensor") else
                            {"bool": False, "int": 1, "float": 1.0}[t])
            assert op(*args) is None, name


CASES = [  # b, hq, hk, s, d, causal
    (1, 8, 8, 1024, 128, False),
    (2, 8, 2, 333, 64, True),
]


@pytest.mark.parametrize("case", CASES)
def test_fp4_path_compiles_without_breaks(fp4, case):
    b, hq, hk, s, d, causal = case
    q, k, v = make_qkv(b, hq, hk, s, s, d, torch.bfloat16)
    eager = fp4.sageattn3_blackwell(q, k, v, is_causal=causal)  # self-check and path decided here
    e = explain(fp4.sageattn3_blackwell, q, k, v, is_causal=causal)
    print(f"explain FP4 {case}: graphs {e.graph_count}, graph breaks {e.graph_break_count}")
    assert e.graph_break_count == 0, e.break_reasons
    assert e.graph_count == 1 and "sageattn3.attention" in e.graphs[0].code
    torch._dynamo.reset()
    compiled = torch.compile(fp4.sageattn3_blackwell, fullgraph=True)
    out = compiled(q, k, v, is_causal=causal)
    assert torch.equal(out, eager)
    assert torch.equal(compiled(q, k, v, is_causal=causal), eager)


def test_fp4_path_compiled_first(fp4):
    """Compiled before any eager call: the self-check runs inside the op, at run time."""
    from sageattn3 import _selfcheck

    q, k, v = make_qkv(1, 4, 2, 500, 500, 128, torch.float16)
    out = torch.compile(fp4.sageattn3_blackwell, fullgraph=True)(q, k, v, is_causal=True)
    # both groups (the default's and FP8 P·V's, which the rule may take), once each
    assert _selfcheck.run_count == 2 and _selfcheck.result(q.device).ok
    assert torch.equal(out, fp4.sageattn3_blackwell(q, k, v, is_causal=True)) and _selfcheck.run_count == 2


def test_sdpa_path_compiles_without_breaks(monkeypatch):
    sa = sageattn3_or_skip()
    from sageattn3 import _kernels

    cc = torch.cuda.get_device_capability()
    if cc in FP4_CCS:
        pytest.skip("this GPU takes the FP4 path")
    monkeypatch.delenv(_kernels.FORCE_FP4_ENV, raising=False)
    _reset()
    q, k, v = make_qkv(2, 8, 2, 257, 257, 128, torch.bfloat16)
    e = explain(sa.sageattn3_blackwell, q, k, v, is_causal=True)
    print(f"explain SDPA: graphs {e.graph_count}, graph breaks {e.graph_break_count}")
    assert e.graph_break_count == 0, e.break_reasons
    assert "scaled_dot_product_attention" in e.graphs[0].code
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = torch.compile(sa.sageattn3_blackwell, fullgraph=True)(q, k, v, is_causal=True)
        want = sa.sageattn3_blackwell(q, k, v, is_causal=True)
    assert torch.allclose(out.float(), want.float(), atol=2e-2)
    _reset()


def test_quantizers_and_preprocess_compile_without_breaks():
    sa = sageattn3_or_skip()
    from sageattn3 import _kernels

    why = _kernels.kernels_run_on(torch.device("cuda", torch.cuda.current_device()))
    if why is not None:
        pytest.skip(f"quantization kernels cannot run here: {why}")
    _reset()
    x = torch.randn(2, 3, 256, 128, device="cuda", dtype=torch.bfloat16)
    for fn in (sa.scale_and_quant_fp4, sa.scale_and_quant_fp4_transpose):
        e = explain(fn, x)
        print(f"explain {fn.__name__}: graphs {e.graph_count}, graph breaks {e.graph_break_count}")
        assert e.graph_break_count == 0, e.break_reasons
        torch._dynamo.reset()
        got = torch.compile(fn, fullgraph=True)(x)
        want = fn(x)
        for g, w in zip(got, want):
            assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))
    q, k, v = make_qkv(1, 4, 2, 300, 300, 64, torch.float16)

    def pre(q, k, v):
        p = sa.preprocess(q, k, v)
        return p.q_packed, p.q_scales, p.k_packed, p.k_scales, p.v_packed, p.v_scales, p.mean_q, p.mean_k

    e = explain(pre, q, k, v)
    print(f"explain preprocess: graphs {e.graph_count}, graph breaks {e.graph_break_count}")
    assert e.graph_break_count == 0, e.break_reasons
    torch._dynamo.reset()
    for g, w in zip(torch.compile(pre, fullgraph=True)(q, k, v), pre(q, k, v)):
        assert g.shape == w.shape and torch.equal(g.view(torch.uint8), w.view(torch.uint8))


@pytest.mark.parametrize("causal", [False, True])
def test_cuda_graph_replay_equals_eager(fp4, causal):
    q, k, v = make_qkv(2, 8, 2, 700, 700, 128, torch.bfloat16)
    eager = fp4.sageattn3_blackwell(q, k, v, is_causal=causal)  # warm-up: self-check, path
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fp4.sageattn3_blackwell(q, k, v, is_causal=causal)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fp4.sageattn3_blackwell(q, k, v, is_causal=causal)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    q2, k2, v2 = make_qkv(2, 8, 2, 700, 700, 128, torch.bfloat16, seed=5)
    q.copy_(q2), k.copy_(k2), v.copy_(v2)
    g.replay()
    torch.cuda.synchronize()
    want = fp4.sageattn3_blackwell(q2, k2, v2, is_causal=causal)
    assert torch.equal(out, want)
    assert not torch.equal(want, eager)


def test_names_of_graph_break_free_ops_are_in_the_op_table():
    """The C++ op table (schemas) matches what the loaded library registered."""
    sageattn3_or_skip()
    from sageattn3 import _kernels

    if not _kernels.loaded():
        pytest.skip("extension not loaded")
    for name in _kernels.OUTPUT_WRITING_OPS:
        schema = str(getattr(torch.ops.sageattn3, name).default._schema)
        assert schema.endswith("-> ()") and re.search(r"Tensor\(\w!\)", schema), schema
