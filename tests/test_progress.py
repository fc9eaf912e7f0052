"""A long stage shows it is at work: a live rich line on a terminal, plain heartbeat lines in a
log; and a failing target names the factory's full log of it, whichever stage failed."""

import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ci.stages import pipeline
from ci.runtime.progress import StageProgress, TeeLog, live_terminal
from ci.toolchain.targets import Matrix

REPO = Path(__file__).resolve().parent.parent


def test_plain_heartbeat_where_no_terminal_and_every_line_passes_through(tmp_path):
    lines: list[str] = []
    with StageProgress(lines.append, "build", every=0.3) as slog:
        assert not slog.live  # a logger that does not write to this process's stdout: never a live line
        slog("[build] compiled 1/3 (2 s)")
        time.sleep(1.2)
    assert lines[0] == "[build] compiled 1/3 (2 s)"
    beats = [ln for ln in lines[1:] if re.fullmatch(r"\[build\] still working \(\d+ s\)", ln)]
    assert beats, lines


def test_no_live_line_in_ci_logs(monkeypatch):
    monkeypatch.setenv("CI", "true")
    assert not live_terminal(print)


def test_live_line_on_a_terminal(tmp_path):
    pytest.importorskip("rich")
    # the default logger wrapped in the per-target file log, as ci.stages.pipeline.run_target hands it to each stage
    code = ("import sys, time; from pathlib import Path; from ci.runtime.progress import StageProgress, TeeLog\n"
            "from ci.runtime.log import default_log\n"
            "log = TeeLog(default_log, Path(sys.argv[1]))\n"
            "with StageProgress(log, 'verify', every=0.5) as s:\n"
            "    assert s.live\n"
            "    s('[verify] py3.11: torch 2.13.0')\n"
            "    time.sleep(2.6)\n"
            "print('done')\n")
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "GITHUB_ACTIONS")}
    env.update(TERM="xterm", PYTHONPATH=str(REPO), COLUMNS="120")
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "t.log")], stdin=follower, stdout=follower, stderr=follower,
                            cwd=REPO, env=env, close_fds=True)
    os.close(follower)
    out = b""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ready, _, _ = select.select([leader], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    proc.wait(timeout=30)
    os.close(leader)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text
    assert "[verify] py3.11: torch 2.13.0" in text and "done" in text
    # The live line is redrawn with the elapsed seconds and the latest line (escape codes around it).
    seconds = {int(m) for m in re.findall(r"\[verify\] (\d+) s  \[verify\] py3\.11", text)}
    assert len(seconds) >= 2 and max(seconds) >= 2, text
    assert "still working" not in text
    assert (tmp_path / "t.log").read_text().rstrip().endswith("[verify] py3.11: torch 2.13.0")


def test_tee_log_keeps_every_line(tmp_path):
    seen: list[str] = []
    tee = TeeLog(seen.append, tmp_path / "logs" / "t.log")
    tee("one")
    tee("two\nthree")
    assert seen == ["one", "two\nthree"]
    kept = [ln.split("s ", 1)[1] for ln in (tmp_path / "logs" / "t.log").read_text().splitlines()]
    assert kept == ["one", "two", "three"]


def test_a_failed_stage_names_the_factorys_log_of_its_target(tmp_path):
    """A target that fails at the plan (a Windows target on Linux): the message names
    dist/logs/<target>.log, which holds the stage's lines and the traceback."""
    if sys.platform == "win32":
        pytest.skip("needs a machine where Windows targets cannot be built")
    matrix = Matrix.load()
    target = next(t for t in matrix.targets if t.os.platform == "windows")
    lines: list[str] = []
    runs = pipeline.build_wheels([target], matrix, tmp_path / "dist", verify_pythons=[], log=lines.append)
    assert runs[0].error and runs[0].failed_stage == "plan"
    full = tmp_path / "dist" / "logs" / f"{target.id}.log"
    said = "\n".join(lines)
    assert f"the factory's log of this target (every stage, the traceback): {full}" in said
    assert f"factory log of {target.id} (every stage): {full}" in said
    kept = full.read_text()
    assert "plan stage failed:" in kept and "Traceback" in kept and "cannot be built here" in kept
