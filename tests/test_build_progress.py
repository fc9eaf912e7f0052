"""The build's progress lines arrive as they happen inside cibuildwheel (issue 38, item 8).

There the build runs three processes deep, each writing to a pipe: pip's PEP 517 hook runner ->
ci/release/cibw_project/factory_backend.py -> ``ci/release/cibw/__main__.py build`` -> ``ci.stages.build.run_logged`` -> pip wheel
of the payload. A Python child whose stdout is a pipe block-buffers it, so every line arrived in
one burst when the child exited. Each test here runs a child that prints a progress line with a
plain ``print`` (no flush), then waits for the parent to have seen it: with buffering, the
parent sees it only after the child gave up waiting and ended, and the test fails."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.timeout(120)

# prints a line, waits (at most 15 s) for the parent to create GO, prints another, marks DONE
SLOW_CHILD = textwrap.dedent("""
    import os, sys, time
    go, done = sys.argv[1], sys.argv[2]
    print("{first}")
    deadline = time.monotonic() + 15
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.05)
    print("{second}" if os.path.exists(go) else "parent never saw the first line")
    {extra}
    open(done, "w").close()
""")


def test_run_logged_passes_each_progress_line_on_while_the_child_runs(tmp_path):
    from ci.stages.build import run_logged

    child = tmp_path / "child.py"
    child.write_text(SLOW_CHILD.format(first="sageattn3: compiled 1/2 a.cu (3 s)",
                                       second="sageattn3: compiled 2/2 b.cu (5 s)", extra=""))
    go, done = tmp_path / "go", tmp_path / "done"
    seen: list[tuple[str, bool]] = []

    def log(msg: str) -> None:
        seen.append((msg, done.exists()))
        go.touch()

    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    rc, lines = run_logged([sys.executable, str(child), str(go), str(done)], env, tmp_path / "build.log", log)
    assert rc == 0
    assert seen[0] == ("[build] compiled 1/2 a.cu (3 s)", False)  # while the child still ran
    assert [m for m, _ in seen] == ["[build] compiled 1/2 a.cu (3 s)", "[build] compiled 2/2 b.cu (5 s)"]
    assert (tmp_path / "build.log").read_text().splitlines() == lines


def test_a_progress_line_glued_to_another_threads_echo_is_still_shown(tmp_path):
    """Seen in a full local run: setuptools' echo of one unit's nvcc command, then another
    thread's progress line, then the echo's newline, all on one line of the output."""
    from ci.stages.build import run_logged

    child = tmp_path / "child.py"
    child.write_text("import sys\n"
                     "sys.stdout.write('nvcc -c csrc/a.cu -Ibuild/roots/python')\n"
                     "print('sageattn3: compiled 5/11 csrc/preprocess/k_delta.cu (5 s)')\n"
                     "print('sageattn3: compiled 6/11 csrc/b.cu (6 s)')\n")
    seen: list[str] = []
    rc, lines = run_logged([sys.executable, str(child)], dict(os.environ), tmp_path / "build.log", seen.append)
    assert rc == 0 and lines[0].startswith("nvcc -c csrc/a.cu")
    assert seen == ["[build] compiled 5/11 csrc/preprocess/k_delta.cu (5 s)", "[build] compiled 6/11 csrc/b.cu (6 s)"]


def test_the_cibuildwheel_hook_streams_the_factorys_output_as_it_comes(tmp_path):
    """The hook's own hop: pip runs build_wheel with stdout on a pipe, and the backend runs the
    factory's build (here a stand-in for ci/release/cibw/__main__.py that prints like it) under
    $SAGEATTN3_FACTORY_PYTHON; the first line must reach pip before the build ends."""
    fake_cibw = tmp_path / "cibw.py"
    make_wheel = "open(os.path.join(sys.argv[sys.argv.index('--out') + 1], 'x-1.0-py3-none-any.whl'), 'w').close()"
    fake_cibw.write_text(SLOW_CHILD.replace('go, done = sys.argv[1], sys.argv[2]',
                                            'go, done = os.environ["T_GO"], os.environ["T_DONE"]')
                         .format(first="[build] compiled 1/2 a.cu (3 s)", second="[build] compiled 2/2 b.cu (5 s)",
                                 extra=make_wheel))
    go, done, out = tmp_path / "go", tmp_path / "done", tmp_path / "wheelhouse"
    out.mkdir()
    hook = ("import importlib.util, pathlib, sys\n"
            f"spec = importlib.util.spec_from_file_location('fb', {str(REPO / 'ci' / 'release' / 'cibw_project' / 'factory_backend.py')!r})\n"
            "fb = importlib.util.module_from_spec(spec); spec.loader.exec_module(fb)\n"
            f"fb.CIBW = pathlib.Path({str(fake_cibw)!r})\n"
            f"print('built', fb.build_wheel({str(out)!r}))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env.update(SAGEATTN3_FACTORY_PYTHON=sys.executable, T_GO=str(go), T_DONE=str(done))
    with subprocess.Popen([sys.executable, "-c", hook], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=env) as proc:
        first = proc.stdout.readline().strip()
        build_ended = done.exists()
        go.touch()
        rest = proc.stdout.read()
    assert proc.returncode == 0, rest
    assert (first, build_ended) == ("[build] compiled 1/2 a.cu (3 s)", False)
    assert "[build] compiled 2/2 b.cu (5 s)" in rest and "built x-1.0-py3-none-any.whl" in rest
