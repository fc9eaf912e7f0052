"""One error base with exit codes (ci.runtime.errors): failures exit 1, bad input exits 2, and the
command lines end through one runner that prints the message on one line."""

from __future__ import annotations

import pytest

from ci.runtime import errors


def test_the_runner_maps_the_error_to_its_exit_code_and_one_line(capsys):
    def fail(exc):
        def fn():
            raise exc
        return fn

    assert errors.run_main(lambda: 0) == 0 and errors.run_main(lambda: 3) == 3
    assert errors.run_main(fail(errors.FactoryError("it broke"))) == 1
    assert capsys.readouterr().err == "error: it broke\n"
    assert errors.run_main(fail(errors.InputError("no such target")), prefix="release") == 2
    assert capsys.readouterr().err == "release: no such target\n"
    with pytest.raises(KeyError):  # not the factory's: a bug keeps its traceback
        errors.run_main(fail(KeyError("x")))
    # a command whose messages each name themselves: the message alone
    assert errors.run_main(fail(errors.InputError("usage: python -m x check")), prefix=None) == 2
    assert capsys.readouterr().err == "usage: python -m x check\n"


def test_each_error_class_is_an_input_error_or_a_failure_and_keeps_its_old_base():
    from ci.stages.build import BuildError
    from ci.toolchain.compile_gate import GateError
    from ci.release.docs_site import DocsError
    from ci.toolchain.patches import PatchDrift, PatchError
    from ci.release.publish._net import InputError as PublishInputError
    from ci.release.publish._net import PublishError
    from ci.stages.record import RecordError
    from ci.release import ReleaseError, ReleaseInputError
    from ci.stages.repair import RepairError
    from ci.toolchain.targets import MatrixError
    from ci.toolchain.tools import ToolchainError
    from ci.stages.verify import NoCpuTorch, VerifyError

    for cls in (MatrixError, ToolchainError, GateError, DocsError, RecordError, PatchError, PatchDrift,
                ReleaseInputError, PublishInputError):
        assert issubclass(cls, errors.InputError) and cls.exit_code == 2, cls.__name__
    for cls in (BuildError, RepairError, VerifyError, NoCpuTorch, ReleaseError, PublishError):
        assert issubclass(cls, errors.FactoryError) and not issubclass(cls, errors.InputError), cls.__name__
        assert cls.exit_code == 1, cls.__name__
    assert issubclass(MatrixError, ValueError) and issubclass(BuildError, RuntimeError)
    assert issubclass(ReleaseInputError, ReleaseError) and issubclass(PublishInputError, PublishError)


def test_a_failed_child_command_is_a_factory_failure_with_its_stderr(capsys):
    """A child command whose output the toolchain reads (ci.toolchain.tools.base._output) that fails ends a command line with exit status 1
    and its stderr's last lines, not a traceback; code catching CalledProcessError still does."""
    import subprocess
    import sys

    from ci.toolchain.tools import CommandFailed
    from ci.toolchain.tools.base import _output

    def fn():
        _output([sys.executable, "-c", "import sys; sys.stderr.write('torch is broken here\\n'); sys.exit(3)"])
        return 0

    assert errors.run_main(fn) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: Command ") and "returned non-zero exit status 3" in err and "torch is broken here" in err
    assert issubclass(CommandFailed, subprocess.CalledProcessError) and not issubclass(CommandFailed, errors.InputError)


# -- each command line's bad input, through the shared runner (nothing is built or fetched) ----------

BAD_INPUT = [
    ("ci.__main__", ["build-wheels", "--target", "nope"], "error: unknown target 'nope'"),
    ("ci.toolchain.patches.__main__", ["list", "--target", "nope"], "error: unknown target 'nope'"),
    ("ci.toolchain.compile_gate.__main__", ["--line", "9.99"], "error: torch line(s) ['9.99'] are not in the matrix"),
    ("ci.release.docs_site.__main__", ["--repo", "bad"], "docs: repository 'bad': expected OWNER/NAME"),
    ("ci.release.__main__", ["gather", "--plan", '{"include": [{"id": "x"}]}', "--artifacts", "ART",
                             "--out", "OUT", "--build-outputs", "not json"], "release: --build-outputs: not a JSON document or @file"),
]


@pytest.mark.parametrize("module, argv, message", BAD_INPUT, ids=[b[0] for b in BAD_INPUT])
def test_bad_input_exits_2_through_the_runner(module, argv, message, capsys, monkeypatch, tmp_path):
    import importlib

    mod = importlib.import_module(module)
    seen = []
    monkeypatch.setattr(mod, "run_main", lambda fn, **kw: seen.append(kw) or errors.run_main(fn, **kw))
    argv = [str(tmp_path / a) if a in ("ART", "OUT") else a for a in argv]
    (tmp_path / "ART").mkdir()
    assert mod.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err
    assert seen, f"{module}.main does not end through ci.runtime.errors.run_main"


def test_the_standin_image_failure_exits_1_through_the_runner(capsys, monkeypatch):
    from ci.release import standin_image
    from ci.release.standin_image import __main__ as standin_cli

    def broken():
        raise standin_image.StandinImageError("podman is not installed")

    monkeypatch.setattr(standin_cli, "image_name", broken)
    assert standin_cli.main(["--print-name"]) == 1
    assert capsys.readouterr().err == "standin-image: podman is not installed\n"
