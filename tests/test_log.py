"""The factory's one logger (ci.runtime.log): it writes what print wrote, where print wrote it;
its progress and its tee are the ones of ci.runtime.progress; whether a live line may be drawn is
the logger's to say. And no function of ci/ takes print as its logger any more."""

from __future__ import annotations

import ast
import io
import re
import sys
import time
from pathlib import Path

import pytest

from ci.checks.layers import module_names
from ci.runtime.log import Log, default_log
from ci.runtime.progress import StageProgress, TeeLog, live_terminal

CI = Path(__file__).resolve().parent.parent / "ci"


def test_the_default_logger_writes_what_print_writes(capsys):
    for msg in ("one line", "two\nlines", "", "[build] 3 s"):
        print(msg)
        printed = capsys.readouterr()
        default_log(msg)
        assert capsys.readouterr() == printed


def test_the_default_logger_looks_up_stdout_at_each_call(monkeypatch):
    # a live progress line (rich) redirects sys.stdout while it is shown: the logger must follow
    buf = io.StringIO()
    monkeypatch.setattr(sys, "stdout", buf)
    default_log("here")
    assert buf.getvalue() == "here\n"


def test_a_logger_with_a_backend_and_of():
    seen: list[str] = []
    log = Log(seen.append)
    log("a")
    assert seen == ["a"] and Log.of(log) is log and Log.of(default_log) is default_log
    assert Log.of(seen.append).backend == seen.append


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_logger_says_whether_it_reaches_the_terminal(monkeypatch, tmp_path):
    pytest.importorskip("rich")
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    monkeypatch.setattr(sys, "stdout", _Tty())
    assert default_log.terminal and live_terminal(default_log)
    assert live_terminal(default_log.tee(tmp_path / "t.log"))  # a tee of it writes the terminal too
    assert live_terminal(TeeLog(default_log, tmp_path / "u.log"))
    assert not live_terminal(Log([].append)) and not live_terminal([].append)
    assert not live_terminal(print)  # print is no logger: only a logger says where it writes
    monkeypatch.setenv("CI", "true")
    assert not live_terminal(default_log)
    monkeypatch.delenv("CI")
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    assert not live_terminal(default_log)


def test_tee_keeps_every_line_and_passes_it_on(tmp_path):
    seen: list[str] = []
    tee = Log(seen.append).tee(tmp_path / "logs" / "t.log")
    assert isinstance(tee, Log) and isinstance(tee.backend, TeeLog)
    tee("one")
    tee("two\nthree")
    assert seen == ["one", "two\nthree"]
    kept = [ln.split("s ", 1)[1] for ln in (tmp_path / "logs" / "t.log").read_text().splitlines()]
    assert kept == ["one", "two", "three"]


def test_step_is_the_stage_progress(tmp_path):
    lines: list[str] = []
    with Log(lines.append).step("build", every=0.3) as slog:
        assert isinstance(slog, StageProgress) and not slog.live
        slog("[build] compiled 1/3 (2 s)")
        time.sleep(1.2)
    assert lines[0] == "[build] compiled 1/3 (2 s)"
    assert [ln for ln in lines[1:] if re.fullmatch(r"\[build\] still working \(\d+ s\)", ln)], lines


# -- no function of ci/ takes print as its logger --------------------------------------------------

def print_as_logger(source: str) -> list[str]:
    """Where ``source`` hands ``print`` over as a value: a parameter's default, a call's argument
    (``log=print``, or positional)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            args = node.args
            for default in [*args.defaults, *(d for d in args.kw_defaults if d is not None)]:
                if isinstance(default, ast.Name) and default.id == "print":
                    found.append(f"line {default.lineno}: a parameter defaults to print")
        elif isinstance(node, ast.Call):
            for kw in node.keywords:
                if isinstance(kw.value, ast.Name) and kw.value.id == "print":
                    found.append(f"line {kw.value.lineno}: {kw.arg}=print")
            for arg in node.args:
                if isinstance(arg, ast.Name) and arg.id == "print":
                    found.append(f"line {arg.lineno}: print passed")
    return found


def test_no_function_of_ci_takes_print_as_its_logger():
    found = {m: bad for m, path in module_names(CI).items() if (bad := print_as_logger(path.read_text(encoding="utf-8")))}
    assert not found, f"use ci.runtime.log.default_log (or a Log) instead of print: {found}"


@pytest.mark.parametrize("source", [
    "def f(x, log=print):\n    log(x)\n",
    "def f(x, *, log=print):\n    log(x)\n",
    "def f(x, log: Callable[[str], None] = print):\n    pass\n",
    "g = lambda log=print: log\n",
    "def f():\n    build(t, log=print)\n",
    "def f():\n    StageProgress(print, 'build')\n",
])
def test_the_check_finds_print_handed_over(source):
    assert print_as_logger(source)


def test_the_check_leaves_calls_of_print_alone():
    assert print_as_logger("def f(log=default_log):\n    print('x', file=sys.stderr)\n    log('print')\n") == []
