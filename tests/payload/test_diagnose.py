"""`python -m sageattn3` / sageattn3.diagnose() on this CPU-only machine: the report, its JSON,
the exit status and its reasons; an installed-like copy whose ABI guard refuses this torch or
whose extension fails to load still gets a report (exit 4) instead of a traceback; the exit
status rules on synthetic reports (self-check or accuracy failure 5, mismatch 4, no FP4 3)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import sageattn3
from sageattn3 import _diagnose as dg

SRC = Path(__file__).resolve().parents[2] / "sageattn3"
CPU_ONLY = torch.version.cuda is None or not torch.cuda.is_available()


def run_main(args, pythonpath, cwd):
    return subprocess.run([sys.executable, "-m", "sageattn3", *args], cwd=cwd, capture_output=True, text=True,
                          env={"PYTHONPATH": str(pythonpath), "PATH": ""})


@pytest.mark.skipif(not CPU_ONLY, reason="the CPU-only report")
def test_cpu_only_report_says_why_no_fp4(tmp_path):
    out = tmp_path / "r.json"
    res = run_main(["--quick", "--json", str(out)], SRC, tmp_path)
    assert res.returncode == dg.EXIT_NO_FP4 == 3, res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    assert "Result: exit 3: FP4 unavailable" in res.stdout
    assert f"report written to {out}" in res.stdout
    r = json.loads(out.read_text())
    assert r["status"]["code"] == 3
    assert any("CPU-only build" in x for x in r["status"]["reasons"]), r["status"]
    env = r["environment"]
    assert env["torch"] == torch.__version__ and env["torch_cuda"] is None and env["gpus"] == []
    assert env["python"] == sys.version.split()[0]
    assert isinstance(env["torch_cxx11_abi"], bool)
    assert r["build"]["installed_wheel"] is False and "source tree" in r["build"]["extension_problem"]
    assert r["devices"] == [] and r["elapsed_s"] < 10
    assert r["exit_codes"]["3"].startswith("FP4 unavailable")


def test_diagnose_returns_the_same_report_as_a_dict():
    r = sageattn3.diagnose(quick=True)
    assert set(r) >= {"environment", "build", "fit", "devices", "status", "exit_codes"}
    json.dumps(dg.finite_json(r))
    text = dg.format_report(r)
    assert f"Result: exit {r['status']['code']}" in text
    if CPU_ONLY:
        assert r["status"]["code"] == dg.EXIT_NO_FP4


def test_help_lists_the_exit_codes_and_bad_args_exit_2(tmp_path):
    res = run_main(["--help"], SRC, tmp_path)
    assert res.returncode == 0
    for code, meaning in dg.EXIT_CODES.items():
        assert f"  {code}  {meaning}\n" in res.stdout, (code, res.stdout)
    res = run_main(["--bogus"], SRC, tmp_path)
    assert res.returncode == 2 and "unrecognized arguments" in res.stderr


def _installed_copy(tmp_path, record: dict, fake_c: str):
    dst = tmp_path / "site" / "sageattn3"
    shutil.copytree(SRC / "sageattn3", dst, ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__",
                                                                           "_build_record.json"))
    (dst / "_build_record.json").write_text(json.dumps(record))
    (dst / "_C.py").write_text(fake_c)
    return tmp_path / "site"


@pytest.mark.skipif(not CPU_ONLY, reason="needs a torch the cu130 record refuses (a CPU build)")
def test_refused_torch_still_gets_a_report(tmp_path):
    rec = {"version": "0.1.0+cu130.torch2.10.stable", "variant": "cu130.torch2.10.stable", "cuda": "13.0",
           "requires_torch": "torch>=2.10", "archs": ["sm_120a", "sm_121a"],
           "index_url": "https://owner.github.io/sa3/", "extra": {"index_pages": ["cu130/torch2.14"]}}
    site = _installed_copy(tmp_path, rec, "raise ImportError('must not be reached')")
    res = run_main(["--quick", "--json", "-"], site, tmp_path)
    assert res.returncode == dg.EXIT_MISMATCH == 4, res.stderr[-2000:]
    r = json.loads(res.stdout)
    assert r["build"]["installed_wheel"] and not r["build"]["extension_loaded"]
    assert "TorchMismatchError" in r["build"]["extension_problem"]
    assert "must not be reached" not in res.stdout + res.stderr
    assert any("CPU-only build" in p for p in r["fit"]["torch_problems"])
    assert r["fit"]["which"]["url"] == "https://owner.github.io/sa3/" and r["fit"]["which"]["page"] is None
    # one line for it, in the result and in the report: no "uses torch SDPA" (the import refuses)
    (reason,) = r["status"]["reasons"]
    assert r["status"]["code"] == 4 and not r["status"]["also"], r["status"]
    assert reason.startswith("torch ") and "is a CPU-only build" in reason and "python -m sageattn3 which" in reason
    text = run_main(["--quick"], site, tmp_path).stdout
    assert text.count("CPU-only build") == 2 and "SDPA" not in text and "TorchMismatchError" not in text, text
    assert "compiled extension: not loaded: the wheel does not fit this torch (below)" in text
    # a plain import still raises: only the diagnosis tolerates the refusal
    imp = subprocess.run([sys.executable, "-c", "import sageattn3"], cwd=tmp_path, capture_output=True, text=True,
                         env={"PYTHONPATH": str(site), "PATH": ""})
    assert imp.returncode != 0 and "TorchMismatchError" in imp.stderr


def test_extension_load_error_is_reported(tmp_path):
    site = _installed_copy(tmp_path, {"archs": ["sm_120a"]}, "raise ImportError('boom: undefined symbol _Zfoo')")
    res = run_main(["--quick"], site, tmp_path)
    assert res.returncode == dg.EXIT_MISMATCH, res.stdout + res.stderr[-2000:]
    assert "the compiled extension did not load: ImportError: boom: undefined symbol _Zfoo" in res.stdout


# ---------------------------------------------------------------------------------------------
# Exit status rules
# ---------------------------------------------------------------------------------------------


def report(devices, problems=(), loaded=True, cuda=True):
    return {
        "environment": {"cuda_available": cuda, "torch": "2.14.1+cu130", "torch_cuda": "13.0"},
        "build": {"installed_wheel": True, "extension_loaded": loaded, "extension_problem": None if loaded else "x"},
        "fit": {"torch_problems": list(problems)},
        "devices": devices,
    }


GOOD = {"index": 0, "name": "RTX 5090", "fp4": True, "selfcheck": {"ok": True},
        "accuracy": {"ok": True, "cases": [{"case": "D128", "ok": True}]}}


def test_status_all_good():
    assert dg.status(report([GOOD]))["code"] == dg.EXIT_OK


def test_status_wrong_results_win():
    bad = {**GOOD, "accuracy": {"ok": False, "cases": [{"case": "D64 causal", "ok": False}]}}
    st = dg.status(report([bad], problems=["x"]))
    assert st["code"] == dg.EXIT_WRONG and "D64 causal" in st["reasons"][0] and st["also"] == ["x"]
    st = dg.status(report([{**GOOD, "selfcheck": {"ok": False, "summary": "cos-sim 0.3"}}]))
    assert st["code"] == dg.EXIT_WRONG and "cos-sim 0.3" in st["reasons"][0]


def test_status_mismatch_and_no_fp4():
    sdpa = {"index": 0, "name": "H100", "fp4": False, "why_not_fp4": "sm_90 has no FP4 MMA"}
    st = dg.status(report([sdpa]))
    assert st["code"] == dg.EXIT_NO_FP4 and "GPU 0 (H100): sm_90 has no FP4 MMA" in st["reasons"][0]
    assert dg.status(report([GOOD], problems=["your torch uses CUDA 12.8"]))["code"] == dg.EXIT_MISMATCH
    assert dg.status(report([GOOD], loaded=False))["code"] == dg.EXIT_MISMATCH
    st = dg.status(report([], cuda=False))
    assert st["code"] == dg.EXIT_NO_FP4 and "sees no CUDA GPU" in st["reasons"][0]
    # a mixed machine: one GPU with FP4 is enough
    assert dg.status(report([sdpa, {**GOOD, "index": 1}]))["code"] == dg.EXIT_OK


def test_compare_figures():
    a = torch.tensor([1.0, 2.0, 3.0])
    c = dg.compare(a, a)
    assert c["cos"] == pytest.approx(1.0) and c["rel_l1"] == 0 and c["max_abs"] == 0
    c = dg.compare(a * 1.1, a)
    assert c["rel_l1"] == pytest.approx(0.1) and c["max_abs"] == pytest.approx(0.3)
    assert dg.compare(torch.tensor([float("nan")]), a[:1])["finite"] is False


@pytest.mark.parametrize("where", ["missing", "dir"])
def test_unwritable_json_path_is_refused_before_the_run(tmp_path, where):
    target = tmp_path / "no-such-folder" / "r.json" if where == "missing" else tmp_path
    for args in (["--quick", "--json", str(target)], ["which", "--json", str(target)]):
        res = run_main(args, SRC, tmp_path)
        assert res.returncode == dg.EXIT_USAGE, (args, res.stdout[-500:], res.stderr[-1000:])
        assert "Traceback" not in res.stderr and "--json" in res.stderr
        assert ("does not exist" if where == "missing" else "is a directory") in res.stderr
        assert "diagnosis" not in res.stdout  # refused before any report was made


def test_failed_environment_section_is_not_read_as_a_cpu_only_torch():
    r = {"environment": {"error": "ZeroDivisionError: division by zero", "where": "x.py:1"}, "build": {},
         "fit": {}, "devices": []}
    st = dg.status(r)
    assert st["code"] == dg.EXIT_ERROR
    assert not any("CPU-only" in x or "no CUDA GPU" in x for x in st["reasons"] + st.get("also", [])), st


def test_error_sections_carry_the_traceback_frames():
    try:
        dg.finite_json(None)
        1 / 0
    except ZeroDivisionError as e:
        err = dg._error(e)
    assert err["error"].startswith("ZeroDivisionError") and err["traceback"]
    assert all("/" not in f and "\\" not in f for f in err["traceback"])  # file names only, no folders


@pytest.mark.skipif(not CPU_ONLY, reason="the CPU-only report")
def test_cpu_report_says_the_fp4_checks_did_not_run():
    r = sageattn3.diagnose(quick=True, speed=False)
    assert r["sections"] == {"accuracy": True, "speed": False}
    assert "FP4 checks: not run (self-check, accuracy, speed): no CUDA GPU visible" in dg.format_report(r)
