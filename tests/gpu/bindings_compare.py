"""The classic torch-facing unit (csrc/torch/classic.cpp, the per-torch wheels of torch 2.7-2.9)
against the stable one (csrc/torch/stable.cpp) on one GPU: both built from this tree in the
MMA-model test flavour against the same torch (the one installed where this runs), their outputs
compared bit for bit over the attention shapes of the GPU tests and the quantization and
preprocessing shapes of tests/gpu/test_quant_kernels.py and test_preprocess_gpu.py.

    python3 tests/gpu/bindings_compare.py build WORK [JOBS_EACH [PAYLOAD_DIR]]   # WORK/{stable,classic}/site
    python3 tests/gpu/bindings_compare.py save FILE                 # outputs of the importable wheel
    python3 tests/gpu/bindings_compare.py compare A B               # bit identity, exit 1 if not

(`save` runs against whichever sageattn3 is importable, e.g. PYTHONPATH=WORK/classic/site.)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

from msvc_patch_build import build_flavours  # noqa: E402  (same pip wheel + --target install)


def build_config(src: Path, bindings: str, jobs: int) -> dict:
    import torch

    sys.path.insert(0, str(src))
    import build_profile

    home = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    out = subprocess.run([str(home / "bin" / "nvcc"), "--version"], capture_output=True, text=True, check=True).stdout
    cuda = re.search(r"release (\d+\.\d+)", out).group(1)
    cu = "cu" + cuda.replace(".", "")
    line = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    major, minor = (int(x) for x in line.split("."))
    stable = bindings == "stable"
    prof = build_profile.profile(platform="linux", cuda=cuda, archs=["sm_90a"], torch_version=torch.__version__,
                                 stable_abi_floor="2.10" if stable else None, mma_model=True)
    assert prof["torch_unit"].endswith(f"{bindings}.cpp"), prof["torch_unit"]
    variant = f"{cu}.torch2.10.stable" if stable else f"{cu}.torch{line}"
    return {
        "profile": prof, "cuda_home": str(home), "jobs": jobs, "launcher": [],
        "local_label": f"{variant}.mmamodel",
        "requires_torch": "torch>=2.10" if stable else f"torch>={line},<{major}.{minor + 1}",
        "record": {"cuda": cuda, "archs": ["sm_90a"], "torch_build": torch.__version__, "mma_model": True,
                   "variant": variant, "target": f"bindings-{bindings}", "requires_python": ">=3.10"},
    }


def prepare(work: Path, bindings: str, jobs: int, payload: Path) -> Path:
    base = work / bindings
    if base.exists():
        shutil.rmtree(base)
    shutil.copytree(payload, base / "src", ignore=shutil.ignore_patterns(
        "build", "*.egg-info", "__pycache__", "*.so", "_build_record.json"))
    (base / "build-config.json").write_text(json.dumps(build_config(base / "src", bindings, jobs), indent=1))
    return base


# -- outputs --------------------------------------------------------------------------------

def quant_cases():
    import torch

    from test_quant_kernels import special_values

    rows = [(16,), (3, 17, 64), (2, 5, 129, 128), (1, 1, 1, 256), (7, 1000, 48)]
    cols = [(1, 16), (17, 64), (2, 3, 129, 128), (1, 2, 1000, 48), (1, 1, 333, 80)]
    for kind, shapes in (("rows", rows), ("transpose", cols)):
        for dt in (torch.bfloat16, torch.float16, torch.float32):
            for shape in shapes:
                n = 1
                for s in shape:
                    n *= s
                g = torch.Generator(device="cpu").manual_seed(n)
                x = (special_values(n, dt, "cpu").reshape(shape) if n >= 128
                     else torch.randn(shape, generator=g).to(dt))
                yield f"{kind}-{str(dt)[6:]}-{'x'.join(map(str, shape))}", kind, x


def preprocess_cases():
    import torch

    shapes = [(1, 2, 2, 128, 128, 64), (2, 4, 2, 300, 1000, 128), (1, 2, 1, 8300, 300, 64), (1, 8, 1, 777, 5000, 128)]
    for dt in (torch.bfloat16, torch.float16):
        for pbm in (True, False):
            for b, hq, hk, sq, sk, d in shapes:
                g = torch.Generator(device="cpu").manual_seed(b * 1000 + sq + sk + d)
                q = torch.randn(b, hq, sq, d, generator=g) + torch.randn(d, generator=g)
                k = torch.randn(b, hk, sk, d, generator=g) + 3 * torch.randn(d, generator=g)
                v = torch.randn(b, hk, sk, d, generator=g)
                yield f"pre-{str(dt)[6:]}-{'pbm' if pbm else 'one'}-{b}x{hq}x{hk}x{sq}x{sk}x{d}", pbm, (q.to(dt), k.to(dt), v.to(dt))


def save(path: Path) -> None:
    import torch

    import sageattn3
    from msvc_patch_outputs import CASES, case_id, run

    outs = {}
    for c in CASES:
        outs["attn-" + case_id(c)] = run(c).cpu()
    for name, kind, x in quant_cases():
        fn = sageattn3.scale_and_quant_fp4 if kind == "rows" else sageattn3.scale_and_quant_fp4_transpose
        p, s = fn(x.cuda())
        outs[name] = (p.view(torch.uint8).cpu(), s.view(torch.uint8).cpu())
    for name, pbm, (q, k, v) in preprocess_cases():
        pre = sageattn3.preprocess(q.cuda(), k.cuda(), v.cuda(), per_block_mean=pbm)
        outs[name] = {f: (t.view(torch.uint8) if t.dtype != torch.float32 else t).cpu()
                      for f, t in vars(pre).items() if isinstance(t, torch.Tensor)}
    torch.cuda.synchronize()
    torch.save({"build_info": sageattn3.build_info(), "outputs": outs}, path)
    print(json.dumps({"wheel": sageattn3.build_info().get("variant"), "unit": sageattn3.build_info()["flags"]
                      if "flags" in sageattn3.build_info() else None, "cases": len(outs)}))


def _equal(a, b) -> bool:
    import torch

    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.dtype != torch.uint8
                                                                        else a, b.view(torch.uint8) if b.dtype != torch.uint8 else b)


def compare(a_path: Path, b_path: Path) -> int:
    import torch

    a, b = torch.load(a_path), torch.load(b_path)
    va, vb = a["build_info"]["variant"], b["build_info"]["variant"]
    assert va != vb, f"both files come from {va}"
    bad = [k for k in a["outputs"] if k not in b["outputs"] or not _equal(a["outputs"][k], b["outputs"][k])]
    kinds = {}
    for k in a["outputs"]:
        kinds[k.split("-")[0]] = kinds.get(k.split("-")[0], 0) + 1
    print(json.dumps({"a": va, "b": vb, "compared": len(a["outputs"]), "by_kind": kinds, "differ": bad}))
    return 1 if bad or a["outputs"].keys() != b["outputs"].keys() else 0


def main() -> int:
    cmd = sys.argv[1] if len(sys.argv) > 1 else ""
    if cmd == "build" and len(sys.argv) >= 3:
        build_flavours(sys.argv[2:], ("stable", "classic"), prepare)
        return 0
    if cmd == "save" and len(sys.argv) == 3:
        save(Path(sys.argv[2]))
        return 0
    if cmd == "compare" and len(sys.argv) == 4:
        return compare(Path(sys.argv[2]), Path(sys.argv[3]))
    sys.exit(__doc__)


if __name__ == "__main__":
    sys.exit(main())
