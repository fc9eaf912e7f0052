"""The public API on CPU: validation, SDPA fallback, quantization through the reference."""

import subprocess
import sys
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import sageattn3
from sageattn3 import _kernels, api
from sageattn3 import reference as ref

from payload_data import qkv

SRC = Path(__file__).resolve().parents[2] / "sageattn3"


@pytest.fixture(autouse=True)
def fresh_warnings():
    api._warned.clear()
    yield
    api._warned.clear()


def test_public_names():
    for name in ("sageattn3_blackwell", "scale_and_quant_fp4", "scale_and_quant_fp4_permute",
                 "scale_and_quant_fp4_transpose", "blockscaled_fp4_attn", "backend", "is_available",
                 "build_info", "preprocess", "__version__"):
        assert hasattr(sageattn3, name), name


def test_backend_on_cpu():
    assert sageattn3.backend("cpu") == "sdpa: CPU tensors"
    assert sageattn3.is_available("cpu") is False
    if not torch.cuda.is_available():
        assert sageattn3.backend() == "sdpa: CPU tensors"
        assert sageattn3.is_available() is False


def test_blockscaled_fp4_attn_not_implemented_yet():
    q, k, v = qkv(1, 1, 1, 8, 8, 64)
    with pytest.raises(NotImplementedError, match="not implemented"):
        sageattn3.blockscaled_fp4_attn(q, k, v)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_cpu_fallback_matches_sdpa_and_warns_once(dtype, causal):
    q, k, v = qkv(2, 4, 2, 37, 37, 64, dtype=dtype)
    copies = [t.clone() for t in (q, k, v)]
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = sageattn3.sageattn3_blackwell(q, k, v, is_causal=causal)
        out2 = sageattn3.sageattn3_blackwell(q, k, v, is_causal=causal)
    msgs = [str(x.message) for x in w if "sageattn3" in str(x.message)]
    assert len(msgs) == 1 and "CPU tensors" in msgs[0]
    assert out.dtype == dtype and out.shape == q.shape
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=causal)
    assert torch.equal(out, want) and torch.equal(out2, want)
    for t, c in zip((q, k, v), copies):
        assert torch.equal(t, c)


def test_attn_mask_is_refused():
    q, k, v = qkv(1, 1, 1, 8, 8, 64)
    with pytest.raises(NotImplementedError, match="attn_mask"):
        sageattn3.sageattn3_blackwell(q, k, v, attn_mask=torch.ones(8, 8, dtype=torch.bool))


def test_empty_query():
    q, k, v = qkv(1, 2, 2, 0, 5, 64)
    assert sageattn3.sageattn3_blackwell(q, k, v).shape == (1, 2, 0, 64)


@pytest.mark.parametrize(
    "change,exc,match",
    [
        (lambda q, k, v: (q.float(), k, v), TypeError, "q must be one of"),
        (lambda q, k, v: (q, k.half(), v), TypeError, "k has dtype"),
        (lambda q, k, v: (q, k, [1, 2]), TypeError, "v must be a torch.Tensor"),
        (lambda q, k, v: (q[0], k, v), ValueError, "q must be 4-D"),
        (lambda q, k, v: (q, k, v[:, :, :3]), ValueError, "k and v must have the same shape"),
        (lambda q, k, v: (q, k[:1], v[:1]), ValueError, "batch"),
        (lambda q, k, v: (q, k[..., :32], v[..., :32]), ValueError, "head_dim"),
        (lambda q, k, v: (q[:, :3], k, v), ValueError, "multiple of k/v heads"),
        (lambda q, k, v: (q, k[:, :, :0], v[:, :, :0]), ValueError, "sequence length 0"),
        (lambda q, k, v: (q, k.to("meta"), v), ValueError, "k is on meta"),
    ],
)
def test_validation_errors_name_the_argument(change, exc, match):
    q, k, v = qkv(2, 4, 2, 8, 8, 64)
    with pytest.raises(exc, match=match):
        sageattn3.sageattn3_blackwell(*change(q, k, v))


def test_quant_functions_on_cpu_are_the_reference():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 37, 64, generator=g).to(torch.bfloat16)
    p, s = sageattn3.scale_and_quant_fp4(x)
    assert p.shape == (2, 3, 37, 32) and p.dtype == torch.uint8
    assert s.shape == (2, 3, 37, 4) and s.dtype == torch.float8_e4m3fn
    rp, rs = ref.quantize_rows(x)
    assert torch.equal(p, rp) and torch.equal(s.view(torch.uint8), rs.view(torch.uint8))
    pp, ps = sageattn3.scale_and_quant_fp4_permute(x)
    assert torch.equal(pp, p) and torch.equal(ps.view(torch.uint8), s.view(torch.uint8))
    tp, ts = sageattn3.scale_and_quant_fp4_transpose(x)
    assert tp.shape == (2, 3, 64, 24) and ts.shape == (2, 3, 64, 3)


def test_quant_validation():
    with pytest.raises(ValueError, match="multiple of 16"):
        sageattn3.scale_and_quant_fp4(torch.zeros(4, 24))
    with pytest.raises(TypeError, match="x must be one of"):
        sageattn3.scale_and_quant_fp4(torch.zeros(4, 32, dtype=torch.int32))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        sageattn3.scale_and_quant_fp4([1.0] * 16)
    with pytest.raises(ValueError, match="at least 2 dims"):
        sageattn3.scale_and_quant_fp4_transpose(torch.zeros(32))


def test_preprocess_on_cpu_is_the_reference():
    q, k, v = qkv(1, 2, 1, 40, 40, 64)
    pre = sageattn3.preprocess(q, k, v)
    assert pre.q_packed.shape == (1, 2, 128, 32)
    with pytest.raises(ValueError, match="pad"):
        sageattn3.preprocess(q, k, v, pad=10)


@pytest.mark.parametrize(
    "arch,cc,ok",
    [("sm_120a", (12, 0), True), ("sm_120a", (12, 1), False), ("sm_121a", (12, 1), True),
     ("sm_120f", (12, 1), True), ("sm_120f", (9, 0), False), ("sm_90a", (9, 0), True),
     ("sm_90", (9, 0), True), ("sm_80", (8, 6), True), ("sm_90a", (12, 0), False), ("bogus", (9, 0), False)],
)
def test_arch_runs_on(arch, cc, ok):
    assert _kernels.arch_runs_on(arch, cc) is ok


def _copy_package(tmp_path, record: bool, fake_c: str | None):
    dst = tmp_path / "sageattn3"
    shutil.copytree(SRC / "sageattn3", dst, ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__", "_build_record.json"))
    if record:
        (dst / "_build_record.json").write_text('{"variant": "cu130.torch2.10.stable", "archs": ["sm_120a"]}')
    if fake_c is not None:
        (dst / "_C.py").write_text(fake_c)
    return tmp_path


def _run(path, code):
    return subprocess.run([sys.executable, "-c", code], cwd=path, capture_output=True, text=True,
                          env={"PYTHONPATH": str(path), "PATH": ""})


@pytest.mark.parametrize("record", [False, True])
def test_source_tree_without_extension_imports(tmp_path, record):
    path = _copy_package(tmp_path, record=record, fake_c=None)
    res = _run(path, "import sageattn3; print(sageattn3.backend('cpu')); print(sageattn3._kernels.NOT_LOADED_REASON)")
    assert res.returncode == 0, res.stderr
    assert "source tree without the compiled extension" in res.stdout


def test_installed_wheel_propagates_load_errors(tmp_path):
    # a wheel (record + _C present) whose extension fails to load must not be silenced;
    # the record says CPU-only torch is a mismatch unless this torch has CUDA 13
    path = _copy_package(tmp_path, record=True, fake_c="raise ImportError('boom: undefined symbol')")
    # a record the ABI guard accepts for any torch (no variant), so the load itself fails
    (path / "sageattn3" / "_build_record.json").write_text('{"archs": ["sm_120a"]}')
    res = _run(path, "import sageattn3")
    assert res.returncode != 0
    assert "boom: undefined symbol" in res.stderr


def test_installed_wheel_runs_the_abi_guard_first(tmp_path):
    path = _copy_package(tmp_path, record=True, fake_c="raise ImportError('must not be reached')")
    res = _run(path, "import torch, sys; sys.exit(0 if torch.version.cuda is None else 3)")
    if res.returncode == 3:
        pytest.skip("this torch has CUDA: the CPU-only mismatch cannot be shown")
    res = _run(path, "import sageattn3")
    assert "TorchMismatchError" in res.stderr and "must not be reached" not in res.stderr
