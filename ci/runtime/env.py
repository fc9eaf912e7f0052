"""The process environment, read in one place.

:class:`FactoryEnv` holds every variable the factory reads (its own ``SAGEATTN3_*`` settings and
those a CI runner, a toolchain or the OS sets), each parsed once into a typed field whose
metadata names the variable, its default and the modules that read it. The modules of ``ci/``
call :meth:`FactoryEnv.from_environ` where they need a value (no caching: tests change the
environment between calls), except the build stages: a target's settings are read once, when its
toolchain is resolved, and travel frozen in ``ResolvedToolchain.settings`` (ci/toolchain/resolved.py)
to the build, repair and record; a child process's environment comes from :func:`child_environ`,
and the few changes the factory makes to its own environment go through :func:`set_environ`
and :func:`setdefault_environ`.

A value that does not parse (``MAX_JOBS=x``) raises its error where that field is read, as
the read did before it came here, never where another field is. The table in
``docs/environment.md`` is generated from the fields (``python -m ci environment --write-docs``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

DOC_BLOCK = "environment"


@dataclass(frozen=True)
class _Bad:
    """A value that did not parse: its error, raised when the field is read."""

    error: Exception


def _var(name: str, kind: str, default: str, readers: str, what: str,
         parse: Callable[[str | None], object] | None = None, *, value=None):
    """A field for the variable ``name``: ``kind`` and ``default`` as the table shows them,
    ``readers`` the modules that read it, ``parse`` (the raw value or None) its value."""
    return field(default=value, metadata={"name": name, "kind": kind, "default": default, "readers": readers,
                                          "what": what, "parse": parse or (lambda raw: raw)})


def _nonempty(raw: str | None) -> str | None:
    return raw or None


def _path(raw: str | None) -> Path | None:
    return Path(raw) if raw else None


def _flag(raw: str | None) -> bool:
    return bool(raw)


def _stripped(raw: str | None) -> str:
    return (raw or "").strip()


@dataclass(frozen=True)
class FactoryEnv:
    """Every variable of the process environment the factory reads, typed."""

    # -- the factory's own settings ---------------------------------------------------------
    target: str | None = _var("SAGEATTN3_TARGET", "str", "unset", "ci.release.cibw, ci.release.cibw.__main__",
                              "the target a cibuildwheel hook works on", _nonempty)
    build_python: str | None = _var("SAGEATTN3_BUILD_PYTHON", "str (X.Y)", "the target's Python",
                                    "ci.stages.resolve",
                                    "the Python cibuildwheel builds with (set by the backend shim)", _nonempty)
    factory_python: str | None = _var("SAGEATTN3_FACTORY_PYTHON", "str (path)", "the running interpreter",
                                      "ci.release.cibw_project.factory_backend",
                                      "the interpreter the backend shim runs the factory with (the shim reads it "
                                      "itself: it runs where ci cannot be imported)", _nonempty)
    dist: Path | None = _var("SAGEATTN3_DIST", "Path", "dist/", "ci.release.cibw",
                             "the output root of the cibuildwheel hooks", _path)
    ci_cleanup: bool = _var("SAGEATTN3_CI_CLEANUP", "flag (=1)", "off", "ci.release.cibw",
                            "remove the build's torch environments after a CI build",
                            lambda raw: raw == "1", value=False)
    log_dir: Path | None = _var("SAGEATTN3_LOG_DIR", "Path", "unset", "ci.release.cibw",
                                "where a hook copies the build's full log", _path)
    verify_pythons: tuple[str, ...] | None = _var(
        "SAGEATTN3_VERIFY_PYTHONS", "str (X.Y ...)", "the target's Python", "ci.release.cibw",
        "the Pythons the test hook verifies in", lambda raw: None if raw is None else tuple(raw.split()))
    foreign_torch_dir: str | None = _var("SAGEATTN3_FOREIGN_TORCH_DIR", "str", "cpu", "ci.release.cibw",
                                         "the index directory of the foreign torch the ABI guard is checked with",
                                         _nonempty)
    cibw_payload: str | None = _var("SAGEATTN3_CIBW_PAYLOAD", "str (path)", "unset (the factory's stages)",
                                    "ci.release.cibw",
                                    "a project directory, relative to the project root, holding a `cibw_stages.py` "
                                    "that defines the stages the cibuildwheel hooks run instead of the factory's",
                                    _nonempty)
    index_url: str = _var("SAGEATTN3_INDEX_URL", "str (URL)", "the Pages site, else dist/index/", "ci.stages.build",
                          "the index a wheel's build record names", _stripped, value="")
    pytorch_index: str | None = _var("SAGEATTN3_PYTORCH_INDEX", "str (URL)", "PyTorch's index",
                                     "ci.toolchain.torch_source", "the PyTorch index root torch comes from",
                                     _nonempty)
    targets_file: Path | None = _var("SAGEATTN3_TARGETS_FILE", "Path", "ci/targets.toml", "ci.toolchain.targets",
                                     "the target matrix", _path)
    patch_manifest: Path | None = _var("SAGEATTN3_PATCH_MANIFEST", "Path", "the patches' manifest",
                                       "ci.toolchain.patches", "the patch manifest", _path)
    cache: Path | None = _var("SAGEATTN3_CACHE", "Path", "$XDG_CACHE_HOME/sageattn3-factory", "ci.toolchain.tools.base",
                              "the factory's cache", _path)
    no_provision_python: bool = _var("SAGEATTN3_NO_PROVISION_PYTHON", "flag", "off", "ci.toolchain.tools.pythons",
                                     "never install a missing Python", _flag, value=False)
    no_ccache: bool = _var("SAGEATTN3_NO_CCACHE", "flag", "off", "ci.toolchain.tools.compilers",
                           "compile without sccache", _flag, value=False)
    wine: str | None = _var("SAGEATTN3_WINE", "str (path)", "wine64 on PATH", "ci.toolchain.wine",
                            "the wine64 loader", _nonempty)
    write_interval: float = _var("SAGEATTN3_WRITE_INTERVAL", "float (s)", "1.0", "ci.release.publish.__main__",
                                 "the pause between GitHub API writes",
                                 lambda raw: 1.0 if raw is None else float(raw), value=1.0)
    publish_log: str = _var("SAGEATTN3_PUBLISH_LOG", "str (level)", "WARNING", "ci.release.publish.__main__",
                            "the logging level of publishing", lambda raw: "WARNING" if raw is None else raw,
                            value="WARNING")
    publish_traceback: bool = _var("SAGEATTN3_PUBLISH_TRACEBACK", "flag", "off", "ci.release.publish.__main__",
                                   "show a publishing error's traceback", _flag, value=False)
    python_overrides: tuple[tuple[str, str], ...] = _var(
        "SAGEATTN3_PYTHON_3_<minor>", "str (path)", "searched", "ci.toolchain.tools.pythons",
        "the interpreter for Python 3.<minor>",
        lambda raw: (), value=())
    # -- CI runners ------------------------------------------------------------------------
    ci: bool = _var("CI", "flag", "off", "ci.runtime.progress", "no live progress line", _flag, value=False)
    github_repository: str = _var("GITHUB_REPOSITORY", "str (OWNER/NAME)", "unset", "ci.stages.build",
                                  "the repository whose Pages site is the index", _stripped, value="")
    github_env: str | None = _var("GITHUB_ENV", "str (path)", "unset", "ci.release.cibw.__main__",
                                  "the file a step exports variables through")
    github_path: str | None = _var("GITHUB_PATH", "str (path)", "unset", "ci.release.runner_setup",
                                   "the file a step adds to PATH through", _nonempty)
    github_output: str | None = _var("GITHUB_OUTPUT", "str (path)", "unset", "ci.release.__main__",
                                     "the file a step writes its outputs to")
    github_step_summary: str | None = _var("GITHUB_STEP_SUMMARY", "str (path)", "unset", "ci.release.__main__",
                                           "the job summary file")
    github_ref_name: str | None = _var("GITHUB_REF_NAME", "str", "unset", "ci.release.__main__", "the tag released")
    github_sha: str | None = _var("GITHUB_SHA", "str", "unset", "ci.release.publish.__main__",
                                  "the commit a release is made at", _nonempty)
    github_api_url: str | None = _var("GITHUB_API_URL", "str (URL)", "https://api.github.com",
                                      "ci.release.publish.__main__", "GitHub's REST API")
    github_token: str = _var("GITHUB_TOKEN", "str (secret)", "unset", "ci.release.publish._net",
                             "the token publishing uses", _stripped, value="")
    gh_token: str = _var("GH_TOKEN", "str (secret)", "unset", "ci.release.publish._net",
                         "the token publishing uses when GITHUB_TOKEN is unset", _stripped, value="")
    twine_username: str | None = _var("TWINE_USERNAME", "str", "unset", "ci.release.publish.pypi, ci.release.publish._net",
                                      "the PyPI-compatible server's user")
    twine_password: str | None = _var("TWINE_PASSWORD", "str (secret)", "unset",
                                      "ci.release.publish.pypi, ci.release.publish._net",
                                      "the PyPI-compatible server's password")
    runner_tool_cache: str | None = _var("RUNNER_TOOL_CACHE", "str (path)", "C:\\hostedtoolcache\\windows",
                                         "ci.toolchain.tools.pythons", "the runners' hosted tool cache (Windows)", _nonempty)
    agent_toolsdirectory: str | None = _var("AGENT_TOOLSDIRECTORY", "str (path)", "unset", "ci.toolchain.tools.pythons",
                                            "the hosted tool cache, other runners", _nonempty)
    # -- toolchains and the OS ------------------------------------------------------------
    term: str | None = _var("TERM", "str", "unset", "ci.runtime.progress", "dumb: no live progress line")
    path: str | None = _var("PATH", "str", "unset", "ci.stages.build, ci.stages.repair",
                            "extended for the compiler and auditwheel")
    source_date_epoch: str = _var("SOURCE_DATE_EPOCH", "str (seconds)", "315532800", "ci.stages.repair",
                                  "the timestamp of repaired wheels",
                                  lambda raw: "315532800" if raw is None else raw, value="315532800")
    max_jobs: int | None = _var("MAX_JOBS", "int", "from the machine's cores and memory", "ci.release.cibw",
                                "parallel compile jobs", lambda raw: int(raw) if raw else None)
    cuda_home: str | None = _var("CUDA_HOME", "str (path)", "searched", "ci.toolchain.tools.cuda, ci.checks.kernel_report",
                                 "the CUDA toolkit", _nonempty)
    cuda_path: str | None = _var("CUDA_PATH", "str (path)", "searched", "ci.toolchain.tools.cuda",
                                 "the CUDA toolkit (Windows)", _nonempty)
    cuda_path_versions: tuple[str, ...] = _var(
        "CUDA_PATH_V<major>_<minor>", "str (path)", "unset", "ci.toolchain.tools.cuda",
        "CUDA toolkits NVIDIA's Windows installer registered, newest name first", lambda raw: (), value=())
    cxx: str | None = _var("CXX", "str", "g++ (compile gate), c++", "ci.toolchain.compile_gate, ci.toolchain.tools.compilers",
                           "the host C++ compiler")
    sccache_dir: str | None = _var("SCCACHE_DIR", "str (path)", "<cache>/sccache",
                                   "ci.toolchain.tools.compilers, ci.checks.bench", "sccache's cache", _nonempty)
    xdg_cache_home: str | None = _var("XDG_CACHE_HOME", "str (path)", "~/.cache", "ci.toolchain.tools.base",
                                      "where the cache goes", _nonempty)
    pyenv_root: str | None = _var("PYENV_ROOT", "str (path)", "~/.pyenv", "ci.toolchain.tools.pythons",
                                  "pyenv's installs", _nonempty)
    localappdata: str = _var("LOCALAPPDATA", "str (path)", "empty", "ci.toolchain.tools.pythons",
                             "per-user python.org installs (Windows)", lambda raw: raw or "",
                             value="")
    program_files: str = _var("ProgramFiles", "str (path)", "C:\\Program Files",
                              "ci.toolchain.tools.pythons, ci.toolchain.tools.cuda, ci.release.runner_setup",
                              "Windows' program folder",
                              lambda raw: "C:\\Program Files" if raw is None else raw, value="C:\\Program Files")
    program_files_x86: str = _var("ProgramFiles(x86)", "str (path)", "C:\\Program Files (x86)",
                                  "ci.release.runner_setup", "where vswhere is",
                                  lambda raw: "C:\\Program Files (x86)" if raw is None else raw,
                                  value="C:\\Program Files (x86)")
    actionlint: str | None = _var("ACTIONLINT", "str (path)", "on PATH, else installed", "ci.release.workflow_lint",
                                  "the actionlint executable", _nonempty)
    zizmor: str | None = _var("ZIZMOR", "str (path)", "on PATH, else installed", "ci.release.workflow_lint",
                              "the zizmor executable", _nonempty)

    def __getattribute__(self, name: str):
        value = object.__getattribute__(self, name)
        if isinstance(value, _Bad):
            raise value.error
        return value

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "FactoryEnv":
        """The factory's view of ``environ`` (default: :data:`os.environ` now)."""
        environ = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for f in fields(cls):
            try:
                values[f.name] = f.metadata["parse"](environ.get(f.metadata["name"]))
            except ValueError as e:
                values[f.name] = _Bad(e)
        values["python_overrides"] = tuple(sorted((k, v) for k, v in environ.items()
                                                  if k.startswith("SAGEATTN3_PYTHON_3_")))
        values["cuda_path_versions"] = tuple(v for k, v in sorted(environ.items(), reverse=True)
                                             if k.upper().startswith("CUDA_PATH_V"))
        return cls(**values)

    @classmethod
    def variable(cls, field_name: str) -> str:
        """The variable the field ``field_name`` reads (``variable("max_jobs")`` -> ``MAX_JOBS``)."""
        return next(f.metadata["name"] for f in fields(cls) if f.name == field_name)

    def python_override(self, version: str) -> str | None:
        """``$SAGEATTN3_PYTHON_3_X`` for ``version`` ("3.X"), None when unset or empty."""
        return dict(self.python_overrides).get(python_override_var(version)) or None

    def token(self) -> str:
        """The GitHub token publishing uses (GITHUB_TOKEN, else GH_TOKEN), empty when neither is set."""
        return self.github_token or self.gh_token


def python_override_var(version: str) -> str:
    """The variable naming the interpreter for ``version`` ("3.12" -> ``SAGEATTN3_PYTHON_3_12``)."""
    return "SAGEATTN3_PYTHON_" + version.replace(".", "_")


def child_environ(*updates: Mapping[str, str] | None, drop_prefixes: tuple[str, ...] = (),
                  drop: tuple[str, ...] = (), **overrides: str) -> dict[str, str]:
    """A child process's environment: this process's, less the variables named in ``drop`` or
    starting with one of ``drop_prefixes``, then ``updates`` (mappings, None skipped) and
    ``overrides`` laid over it in that order."""
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith(drop_prefixes)}
    for u in updates:
        env.update(u or {})
    env.update(overrides)
    return env


def set_environ(name: str, value: str | None) -> None:
    """Set ``name`` in this process's environment (its children inherit it); None unsets it."""
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def setdefault_environ(name: str, value: str) -> None:
    """Set ``name`` in this process's environment unless it is set already."""
    os.environ.setdefault(name, value)


def environment_table() -> str:
    """The markdown table of every variable :class:`FactoryEnv` reads (docs/environment.md)."""
    rows = ["| variable | type | default | read by | what |", "| --- | --- | --- | --- | --- |"]
    for f in fields(FactoryEnv):
        m = f.metadata
        readers = ", ".join(f"`{r.strip()}`" for r in m["readers"].split(","))
        rows.append(f"| `{m['name']}` | {m['kind']} | {m['default'].replace(chr(92), chr(92) * 2)} | {readers} | {m['what']} |")
    return "\n".join(rows)
