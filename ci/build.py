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
import sys
from dataclasses import dataclass
from pathlib import Path

from packaging.version import Version

from ci import cross as crossmod
from ci import patches as patchmod
from ci import torch_source as torch_sources
from ci.flags import PAYLOAD, compiler_for, profile_for
from ci.pip_env import pip_environ
from ci.targets import Matrix, Target
from ci.toolchain import (
    CudaToolkit,
    ToolchainError,
    TorchEnv,
    compiler_launcher,
    cutlass_include,
    find_cuda,
    find_python,
    host_compiler_version,
    sccache_env,
)

REPO = PAYLOAD.parent


class BuildError(RuntimeError):
    pass


def host_os_key() -> str:
    import platform

    machine = platform.machine().lower()
    if sys.platform.startswith("linux"):
        return f"linux-{'aarch64' if machine in ('aarch64', 'arm64') else machine}"
    if sys.platform == "win32":
        return "windows-amd64"
    return f"{sys.platform}-{machine}"


def source_commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "sageattn3", "patches"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def local_blockers(target: Target, *, cross: bool = False) -> list[str]:
    """Why this target cannot be built on this machine (empty: it can). ``cross``: a Linux target
    of another machine counts as buildable when it can be cross-compiled here (``ci.cross``);
    asked for by name (``--target``), never picked up by ``--all-local`` or the release rehearsal."""
    reasons = []
    if crossmod.is_cross(target.os):
        if cross:
            return crossmod.cross_blockers(target)
        how = "" if crossmod.cross_blockers(target) else f"; or cross-build it here with --target {target.id}"
        return [f"needs a {target.os.key} machine (this is {host_os_key()}); the release pipeline builds it{how}"]
    if target.os.key != host_os_key():
        reasons.append(f"needs a {target.os.key} machine (this is {host_os_key()}); the release pipeline builds it")
    unreachable = torch_sources.unreachable_reason(target)
    if unreachable:
        reasons.append(unreachable)
    if Version(target.cuda).major < 13:
        try:
            find_cuda(target.cuda, provision=False)
        except ToolchainError:
            reasons.append(f"needs a CUDA {target.cuda} toolkit (NVIDIA's installer; not on PyPI): set CUDA_HOME")
    return reasons


def build_python(target: Target) -> str:
    """The interpreter that compiles: the running one when it qualifies (abi3 wheels are
    the same for every Python from target.python on), else the target's own.
    ``$SAGEATTN3_BUILD_PYTHON`` (X.Y) chooses it: the release's cibuildwheel shim sets its own,
    the target's oldest, so that verify reuses the build's torch environment."""
    chosen = os.environ.get("SAGEATTN3_BUILD_PYTHON")
    if chosen:
        if Version(chosen) < Version(target.python):
            raise BuildError(f"{target.id}: SAGEATTN3_BUILD_PYTHON={chosen} is older than the target's Python {target.python}")
        find_python(chosen)
        return chosen
    here = "%d.%d" % sys.version_info[:2]
    if Version(here) >= Version(target.python):
        return here
    find_python(target.python)
    return target.python


def torch_spec(target: Target) -> torch_sources.TorchSource:
    """Where the build torch comes from (the same source verify and the release use)."""
    return torch_sources.torch_source(target)


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


TEST_FLAVOUR_LABEL = "mmamodel"
PROOF_FLAVOUR_LABEL = "proof"
# The proof flavour compiles a per-torch target with the CUDA 13 toolkit available here (its own
# 12.x comes only from NVIDIA's installer) and links the CUDA runtime statically, so the module
# loads next to that torch's CUDA 12 runtime. It proves the per-torch path (classic unit, that
# torch's headers and libraries, repair, tag, import, ABI guard); it is never indexed or published.
PROOF_CUDA = "13.0"


@dataclass(frozen=True)
class ResolvedToolchain:
    """Everything a target's build uses, resolved once before anything compiles (the build
    stage and the build record read only this)."""

    target: Target
    profile: dict
    patches: tuple[patchmod.Patch, ...]
    cuda: CudaToolkit
    env: TorchEnv
    host_compiler: str
    launcher: tuple[str, ...]
    cutlass: Path
    flavour: str  # "release" | TEST_FLAVOUR_LABEL | PROOF_FLAVOUR_LABEL
    cross: crossmod.CrossToolchain | None = None  # a Linux target of another machine (ci.cross)

    @property
    def torch_include(self) -> Path:
        """The torch headers compiled against (patches apply to copies of these)."""
        root = self.cross.torch.torch_dir if self.cross else self.env.site_packages / "torch"
        return root / "include"

    @property
    def local_label(self) -> str:
        return self.target.variant.label + ("" if self.flavour == "release" else f".{self.flavour}")


def select_flags(target: Target, matrix: Matrix, *, force_patches: tuple[str, ...] = (), mma_model: bool = False,
                 proof: bool = False) -> tuple[dict, tuple[patchmod.Patch, ...]]:
    """The flag profile and the patches of a build (pure: nothing is installed)."""
    if mma_model and proof:
        raise BuildError("the test flavour and the proof flavour are exclusive")
    if proof and target.variant.stable:
        raise BuildError(f"{target.id}: the proof flavour is for per-torch targets (below the stable-ABI floor)")
    profile = profile_for(target, matrix.stable_abi_floor, mma_model=mma_model,
                          cuda=PROOF_CUDA if proof else None, static_cudart=proof)
    chosen = patchmod.select(
        patchmod.load_manifest(), os_key=target.os.key, compiler=compiler_for(target),
        cuda=target.cuda, torch_version=target.build_torch, force=force_patches,
    )
    return profile, tuple(chosen)


def resolve_toolchain(target: Target, matrix: Matrix, *, force_patches: tuple[str, ...] = (),
                      mma_model: bool = False, proof: bool = False) -> ResolvedToolchain:
    """Find or provision the CUDA toolkit, the torch build environment, CUTLASS, the host
    compiler and the compiler cache for ``target``, and choose its flags and patches."""
    profile, chosen = select_flags(target, matrix, force_patches=force_patches, mma_model=mma_model, proof=proof)
    cuda = find_cuda(PROOF_CUDA if proof else target.cuda)
    if crossmod.is_cross(target.os):
        if proof:
            raise BuildError(f"{target.id}: the proof flavour is for this machine's own targets")
        cross = crossmod.resolve_cross(target.os.machine, target.cuda, target.build_torch)
        env = crossmod.build_env(build_python(target), cross)
        flavour = TEST_FLAVOUR_LABEL if mma_model else "release"
        return ResolvedToolchain(target, profile, chosen, cuda, env, cross.compiler.banner,
                                 tuple(compiler_launcher()), cutlass_include(), flavour, cross)
    env = torch_sources.torch_env_for(build_python(target), torch_spec(target))
    if env.torch_cuda != target.cuda:
        raise ToolchainError(
            f"{target.id}: the build torch is {env.torch_version} (CUDA {env.torch_cuda}); the target "
            f"needs torch {target.build_torch} built for CUDA {target.cuda}"
        )
    flavour = TEST_FLAVOUR_LABEL if mma_model else PROOF_FLAVOUR_LABEL if proof else "release"
    return ResolvedToolchain(target, profile, chosen, cuda, env, host_compiler_version(),
                             tuple(compiler_launcher()), cutlass_include(), flavour)


def _copy_payload(target: Target, profile: dict, patches, build_root: Path | None) -> Path:
    root = (build_root or REPO / "build") / "stage" / compile_key(target, profile, [p.name for p in patches])
    if root.exists():
        shutil.rmtree(root)
    shutil.copytree(
        PAYLOAD, root,
        ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "*.so", "_build_record.json"),
    )
    return root


def stage(target: Target, matrix: Matrix, *, force_patches: tuple[str, ...] = (), build_root: Path | None = None,
          mma_model: bool = False, proof: bool = False) -> tuple[Path, dict, list[patchmod.Patch]]:
    """Copy the payload into its staging dir (the path depends only on what is compiled).
    Returns the staging dir, the flag profile and the patches to apply."""
    profile, chosen = select_flags(target, matrix, force_patches=force_patches, mma_model=mma_model, proof=proof)
    return _copy_payload(target, profile, chosen, build_root), profile, list(chosen)


def index_pages(matrix: Matrix) -> list[str]:
    """Every ``<cu tag>/torch<X.Y>`` page the matrix publishes (the wheel's guard and its
    "which wheel" answer name only these)."""
    return sorted({f"{t.variant.cuda_tag}/torch{line}" for t in matrix.targets for line in t.torch_lines})


INDEX_URL_ENV = "SAGEATTN3_INDEX_URL"


def record_index_url(dist: Path) -> str:
    """The index a wheel's build record names (``python -m sageattn3 which`` and the ABI
    guard's ImportError send users there): ``$SAGEATTN3_INDEX_URL`` when set; in the release
    pipeline (``$GITHUB_REPOSITORY`` = OWNER/NAME) the GitHub Pages site of that repository,
    where the publish job puts the index; otherwise, a local build, the index it writes,
    ``dist/index/``."""
    given = os.environ.get(INDEX_URL_ENV, "").strip()
    if given:
        return given.rstrip("/") + "/"
    repo = os.environ.get("GITHUB_REPOSITORY", "").strip()
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
                "cutlass": "4.2.0.0",
                "compiler_cache": "sccache" if tc.launcher else "none",
            },
            "flags": profile,
            "patches": [p.name for p in tc.patches],
            "source_commit": source_commit(),
            "index_url": index_url or record_index_url(REPO / "dist"),
            "extra": extra,
        },
    }


def build(target: Target, matrix: Matrix, raw_dir: Path, *, force_patches: tuple[str, ...] = (),
          jobs: int | None = None, mma_model: bool = False, proof: bool = False, log=print) -> BuildResult:
    """Build one target's wheel into ``raw_dir`` (emptied first). ``mma_model``: the test
    flavour (adds sm_90a, FP4 MMA replaced by its software model); ``proof``: the proof flavour
    (see PROOF_CUDA); neither is ever published."""
    tc = resolve_toolchain(target, matrix, force_patches=force_patches, mma_model=mma_model, proof=proof)
    return build_resolved(tc, matrix, raw_dir, jobs=jobs, log=log)


def build_resolved(tc: ResolvedToolchain, matrix: Matrix, raw_dir: Path, *, jobs: int | None = None,
                   log=print) -> BuildResult:
    """The build stage proper: stage, patch, write the config, compile (or skip when unchanged)."""
    target, profile, cuda, env = tc.target, tc.profile, tc.cuda, tc.env
    staging = _copy_payload(target, profile, tc.patches, None)
    overlay = staging / "build" / "include-overlay"
    roots = {"src": staging, "torch": tc.torch_include, "cutlass": tc.cutlass}
    for p in tc.patches:
        patchmod.apply(p, roots, overlay)
    config = build_config(tc, matrix, overlay, jobs, index_url=record_index_url(raw_dir.parent.parent))
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
        **sccache_env(),
        "PATH": f"{cuda.home / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
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


def run_logged(cmd: list[str], env: dict, log_path: Path, log=print) -> tuple[int, list[str]]:
    """Run ``cmd`` with its output (stdout and stderr) written to ``log_path`` as it comes, the
    payload's progress lines (compile units n/m, elapsed) passed to ``log``; returns the exit
    status and the output's lines."""
    lines: list[str] = []
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w", encoding="utf-8", errors="replace") as f, \
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             errors="replace") as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            f.write(line)
            f.flush()
            line = line.rstrip("\n")
            lines.append(line)
            if line.lstrip().startswith(PROGRESS_PREFIX):
                log(f"[build] {line.strip()[len('sageattn3: '):]}")
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
