"""`python -m sageattn3 --quick` against the installed wheel on the GPU at hand: on an sm_120/121
GPU (or an H100 with the MMA-model flavour and SAGEATTN3_FORCE_FP4=1) exit 0 with the self-check,
accuracy and speed sections (model timings labelled); on a GPU without the FP4 MMA and a normal
wheel, exit 3 naming the GPU and the reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from gpu_common import sageattn3_or_skip

FP4_CCS = ((12, 0), (12, 1))


def diagnose(tmp_path, **env):
    sa = sageattn3_or_skip()
    out = tmp_path / "r.json"
    site = os.path.dirname(os.path.dirname(sa.__file__))
    e = {**os.environ, "PYTHONPATH": site, **env}
    for k, v in env.items():
        if v is None:
            e.pop(k)
    res = subprocess.run([sys.executable, "-m", "sageattn3", "--quick", "--json", str(out)], cwd=tmp_path,
                         capture_output=True, text=True, env=e, timeout=300)
    print(res.stdout[-6000:])
    assert "Traceback" not in res.stderr, res.stderr[-4000:]
    return res, json.loads(out.read_text())


def test_fp4_report(tmp_path):
    sageattn3_or_skip()
    from sageattn3 import _kernels

    cc = torch.cuda.get_device_capability()
    model = _kernels.mma_model_build()
    if cc not in FP4_CCS and not model:
        pytest.skip("no FP4 path on this GPU with this wheel")
    res, r = diagnose(tmp_path, SAGEATTN3_FORCE_FP4="1")
    assert res.returncode == 0, r["status"]
    d = r["devices"][0]
    assert d["fp4"] and d["selfcheck"]["ok"] and d["accuracy"]["ok"]
    for c in d["accuracy"]["cases"]:
        assert c["vs_reference"]["cos"] >= 0.999 and c["vs_exact"]["cos"] >= 0.99, c
    rows = [row for row in d["speed"]["rows"] if "kernel_ms" in row]
    assert rows and all(row["kernel_ms"] > 0 and row["sdpa_ms"] > 0 for row in rows)
    if model and cc not in FP4_CCS:
        assert "MMA model: not Blackwell timing" in res.stdout
        assert d["speed"]["label"] == "MMA model: not Blackwell timing"
        assert all(row["label"] == "MMA model: not Blackwell timing" for row in rows)
    assert r["environment"]["gpus"][0]["sm_count"] == torch.cuda.get_device_properties(0).multi_processor_count
    assert r["build"]["installed_wheel"] and r["build"]["extension_loaded"] and r["build"]["ops_without_fake"] == []
    assert r["elapsed_s"] < 60


def test_no_fp4_report(tmp_path):
    sageattn3_or_skip()
    cc = torch.cuda.get_device_capability()
    if cc in FP4_CCS:
        pytest.skip("this GPU has the FP4 MMA")
    res, r = diagnose(tmp_path, SAGEATTN3_FORCE_FP4=None)
    assert res.returncode == 3, r["status"]
    reason = r["status"]["reasons"][0]
    assert f"sm_{cc[0]}{cc[1]} has no FP4 MMA" in reason and "GPU 0" in reason
    assert r["devices"][0]["fp4"] is False and "selfcheck" not in r["devices"][0]
