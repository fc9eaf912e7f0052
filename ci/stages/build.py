"""The build stage: stage a copy of the payload, apply patches, write the build config,
and compile it with the target's torch and CUDA into ``dist/raw/<target>/``.

The checkout is never modified: everything happens in ``build/stage/<compile key>/``, a path
that depends only on what is compiled (CUDA, archs, torch, flags), so the compiler cache
(sccache) hits across rebuilds and across targets that compile the same thing.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


from ci.runtime.log import default_log
from ci.toolchain import patches as patchmod
from ci.payload.interface import PAYLOAD
from ci.runtime.pip_env import pip_environ
from ci.toolchain.resolved import CUTLASS_VERSION, PROOF_FLAVOUR_LABEL, TEST_FLAVOUR_LABEL, CudaToolkit, ResolvedToolchain, TorchEnv
from ci.toolchain.targets import Matrix, Target
from ci.runtime.errors import FactoryError
from ci.runtime.env import FactoryEnv

REPO = PAYLOAD.parent


class BuildError(FactoryError, RuntimeError):
    pass


def source_commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "sageattn3", "patches"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


@dataclass(frozen=True)
class BuildResult:
    target: Target
    wheel: Path
    config: dict
    cuda: CudaToolkit
    env: TorchEnv


def compile_key(target: Target, profile: dict, patch_names: list[str]) -> str:
    blob = json.dumps([target.cuda, list(target.archs), target.build_torch, profile, patch_names], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def stage(target: Target, profile: dict, patches, build_root: Path | None = None) -> Path:
    """Copy the payload into its staging dir (the path depends only on what is compiled:
    ``build/stage/<compile key>/``)."""
    root = (build_root or REPO / "build") / "stage" / compile_key(target, profile, [p.name for p in patches])
    if root.exists():
        shutil.rmtree(root)
    shutil.copytree(
        PAYLOAD, root,
        ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "*.so", "_build_record.json"),
    )
    return root


def index_pages(matrix: Matrix) -> list[str]:
    """Every ``<cu tag>/torch<X.Y>`` page the matrix publishes (the wheel's guard and its
    "which wheel" answer name only these)."""
    return sorted({f"{t.variant.cuda_tag}/torch{line}" for t in matrix.targets for line in t.torch_lines})


INDEX_URL_ENV = FactoryEnv.variable("index_url")


def record_index_url(dist: Path, settings: FactoryEnv) -> str:
    """The index a wheel's build record names (``python -m sageattn3 which`` and the ABI
    guard's ImportError send users there): ``$SAGEATTN3_INDEX_URL`` when set; in the release
    pipeline (``$GITHUB_REPOSITORY`` = OWNER/NAME) the GitHub Pages site of that repository,
    where the publish job puts the index; otherwise, a local build, the index it writes,
    ``dist/index/``. ``settings``: the toolchain's (``ResolvedToolchain.settings``)."""
    given = settings.index_url
    if given:
        return given.rstrip("/") + "/"
    repo = settings.github_repository
    if repo.count("/") == 1 and all(repo.split("/")):
        owner, name = repo.split("/")
        return f"https://{owner.lower()}.github.io/{name}/"
    return (dist / "index").resolve().as_uri() + "/"


def build_config(tc: ResolvedToolchain, matrix: Matrix, overlay: Path, jobs: int | None = None,
                 index_url: str | None = None) -> dict:
    target, profile = tc.target, tc.profile
    extra = {"torch_lines": list(target.torch_lines), "mma_model": tc.flavour == TEST_FLAVOUR_LABEL,
             "index_pages": index_pages(matrix), "stable_abi_floor": matrix.stable_abi_floor}
    if tc.cross:
        extra["cross"] = tc.cross.record()
    if tc.flavour == PROOF_FLAVOUR_LABEL:
        extra["proof"] = (f"compiled with CUDA {tc.cuda.version} instead of {target.cuda}, CUDA runtime linked "
                          f"statically; proves the per-torch build path; never indexed or published")
    return {
        "profile": profile,
        **({"cross": tc.cross.config()} if tc.cross else {}),
        "cuda_home": str(tc.cuda.home),
        "cutlass_include": str(tc.cutlass),
        "include_overlay": str(overlay) if overlay.exists() else None,
        "local_label": tc.local_label,
        "requires_torch": target.requires_torch,
        "limited_api": target.python_tag,
        "launcher": list(tc.launcher),
        "jobs": jobs or os.cpu_count() or 2,
        "record": {
            "target": target.id,
            "variant": target.variant.label,
            "requires_python": f">={target.floor_python}",
            "torch_build": tc.env.torch_version,
            "cuda": target.cuda,
            "archs": profile["archs"],
            "os": target.os.key,
            "toolchain": {
                "nvcc": tc.cuda.version,
                "cuda_source": tc.cuda.source,
                "host_compiler": tc.host_compiler,
                "python": tc.env.python_version,
                "torch": tc.env.torch_version,
                "cutlass": CUTLASS_VERSION,
                "compiler_cache": "sccache" if tc.launcher else "none",
            },
            "flags": profile,
            "patches": [p.name for p in tc.patches],
            "source_commit": source_commit(),
            "index_url": index_url or record_index_url(REPO / "dist", tc.settings),
            "extra": extra,
        },
    }


def build(tc: ResolvedToolchain, matrix: Matrix, raw_dir: Path, *, jobs: int | None = None, log=default_log) -> BuildResult:
    """Build one target's wheel into ``raw_dir`` (emptied first) with its resolved toolchain
    (ci.stages.resolve.resolve_toolchain): stage, patch, write the config, compile (or skip when
    unchanged)."""
    target, profile, cuda, env = tc.target, tc.profile, tc.cuda, tc.env
    staging = stage(target, profile, tc.patches)
    overlay = staging / "build" / "include-overlay"
    roots = {"src": staging, "torch": tc.torch_include, "cutlass": tc.cutlass}
    for p in tc.patches:
        patchmod.apply(p, roots, overlay)
    if hasattr(tc.cross, "prepare"):  # a Windows build on Linux: its stand-in import libraries
        tc.cross.prepare(staging, profile, overlay, tc.cutlass, log=log)
    config = build_config(tc, matrix, overlay, jobs, index_url=record_index_url(raw_dir.parent.parent, tc.settings))
    cfg_path = staging / "build" / "sageattn3-build-config.json"
    cfg_path.parent.mkdir(parents=True, exist_ok=True)
    cfg_path.write_text(json.dumps(config, indent=2, sort_keys=True))

    digest = inputs_digest(staging, config)
    stamp = raw_dir / ".inputs.sha256"
    done = list(raw_dir.glob("*.whl")) if raw_dir.exists() else []
    if len(done) == 1 and stamp.exists() and stamp.read_text() == digest:
        log(f"[build] {target.id}: up to date (same sources, flags and toolchain)")
        return BuildResult(target, done[0], config, cuda, env)
    if raw_dir.exists():
        shutil.rmtree(raw_dir)
    raw_dir.mkdir(parents=True)
    run_env = {
        **pip_environ(),
        **profile["env"],
        "SAGEATTN3_BUILD_CONFIG": str(cfg_path),
        "CUDA_HOME": str(cuda.home),
        **dict(tc.compiler_env),
        "PATH": f"{cuda.home / 'bin'}{os.pathsep}{tc.settings.path or ''}",
    }
    cmd = [str(env.python), "-m", "pip", "wheel", "-v", "--no-build-isolation", "--no-deps", "-w", str(raw_dir), str(staging)]
    log(f"[build] {target.id}: {' '.join(cmd)}")
    log_path = build_log_path(raw_dir)
    log(f"[build] {target.id}: full log in {log_path}")
    returncode, output = run_logged(cmd, run_env, log_path, log)
    if returncode != 0:
        shutil.rmtree(raw_dir, ignore_errors=True)
        tail = "\n".join(output[-40:])
        raise BuildError(f"{target.id}: compiling failed (pip wheel exited {returncode}; full log: {log_path}); "
                         f"last lines:\n{tail}")
    wheels = list(raw_dir.glob("*.whl"))
    if len(wheels) != 1:
        raise BuildError(f"{target.id}: expected one wheel in {raw_dir}, found {[w.name for w in wheels]}")
    stamp.write_text(digest)
    return BuildResult(target, wheels[0], config, cuda, env)


def build_log_path(raw_dir: Path) -> Path:
    """Where the build stage writes the compile's full output: ``dist/raw/<target>.build.log``."""
    return raw_dir.parent / f"{raw_dir.name}.build.log"


# Lines of the compile worth showing as it goes (the payload's setup.py prints them).
PROGRESS_PREFIX = "sageattn3: compil"


def _flush_stdout() -> None:
    """Our own stdout passed on now: inside cibuildwheel it is a pipe (pip's hook runner), and a
    progress line that waits in Python's buffer arrives with the rest at the end."""
    import sys

    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass


def run_logged(cmd: list[str], env: dict, log_path: Path, log=default_log) -> tuple[int, list[str]]:
    """Run ``cmd`` with its output (stdout and stderr) written to ``log_path`` as it comes, the
    payload's progress lines (compile units n/m, elapsed) passed to ``log``; returns the exit
    status and the output's lines."""
    lines: list[str] = []
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**env, "PYTHONUNBUFFERED": "1"}  # a Python child on a pipe would hold its lines back until it exits
    with open(log_path, "w", encoding="utf-8", errors="replace") as f, \
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             errors="replace", bufsize=1) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            f.write(line)
            f.flush()
            line = line.rstrip("\n")
            lines.append(line)
            # anywhere in the line: the payload's compile threads print under a lock, but setuptools'
            # echo of the next unit's command does not, and print() writes a line and its newline
            # separately, so a progress line can land after another thread's echo, before its newline
            at = line.find(PROGRESS_PREFIX)
            if at >= 0:
                log(f"[build] {line[at + len('sageattn3: '):].strip()}")
                _flush_stdout()
        returncode = proc.wait()
    return returncode, lines


def inputs_digest(staging: Path, config: dict) -> str:
    """Everything a build reads from us: the staged (patched) sources and the build config
    (flags, toolchain versions, torch, label, record). Same digest -> same wheel: the stage
    is skipped (the compiler cache covers the partial case of a change)."""
    h = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    for p in sorted(staging.rglob("*")):
        rel = p.relative_to(staging).as_posix()
        if p.is_file() and not rel.startswith("build/"):
            h.update(rel.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()
