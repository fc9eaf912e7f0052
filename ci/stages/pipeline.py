"""build-wheels: plan -> toolchain + patches + flags -> build -> repair -> tag -> verify -> index.

Each stage leaves its artifact on disk (``dist/raw``, ``dist/repaired``, ``dist/wheels``,
``dist/index``). A wheel reaches ``dist/wheels`` only once it is repaired, tagged and
verified; a failing target leaves nothing there.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ci.runtime.log import Log, default_log
from ci.stages import build as buildmod
from ci.toolchain import cross as crossmod
from ci.toolchain.cross_spec import is_cross
from ci import index as indexmod
from ci.stages import repair as repairmod
from ci.stages import resolve
from ci.stages import verify as verifymod
from ci.runtime.pip_env import pip_environ
from ci.stages.record import BuildRecord, load_records, read_record_in_wheel, record_path
from ci.toolchain.resolved import PROOF_FLAVOUR_LABEL
from ci.stages.tag import tag
from ci.toolchain.targets import Matrix, Target
from ci.toolchain.tools import cache_root


@dataclass
class TargetRun:
    target: Target
    timings: dict[str, float] = field(default_factory=dict)
    wheel: Path | None = None
    error: str | None = None
    verify: verifymod.VerifyReport | None = None
    log_path: Path | None = None  # the compiler's output (dist/raw/<target>.build.log)
    full_log: Path | None = None  # every line the factory said about this target (dist/logs/<target>.log)
    failed_stage: str | None = None

    @contextmanager
    def stage(self, name: str, log=default_log):
        """Time a stage; yields the log function to use inside it (with its progress line)."""
        t0 = time.monotonic()
        try:
            with Log.of(log).step(name) as beat:
                yield beat
        except BaseException:
            self.failed_stage = name
            raise
        finally:
            self.timings[name] = time.monotonic() - t0


def run_target(target: Target, matrix: Matrix, dist: Path, *, verify_pythons: list[str], skip_verify: bool = False,
               force_patches: tuple[str, ...] = (), log=default_log) -> TargetRun:
    run = TargetRun(target, full_log=dist / "logs" / f"{target.id}.log")
    log = Log.of(log).tee(run.full_log)
    tagged_dir = dist / "tagged" / target.id
    raw_dir = dist / "raw" / target.id
    try:
        with run.stage("plan", log):
            blockers = resolve.local_blockers(target, cross=True)
            if blockers:
                raise buildmod.BuildError(f"{target.id} cannot be built here: " + "; ".join(blockers))
        with run.stage("build", log) as slog:
            run.log_path = buildmod.build_log_path(raw_dir)
            slog(f"[build] {target.id}: toolchain (CUDA {target.cuda}, torch {target.build_torch}: the first run "
                 f"installs them into {cache_root()}, minutes), then compile")
            tc = resolve.resolve_toolchain(target, matrix, force_patches=force_patches)
            result = buildmod.build(tc, matrix, raw_dir, log=slog)
        with run.stage("repair", log) as slog:
            # A Windows wheel repaired here: delvewheel finds the VC++ runtime it vendors in PyPI's
            # msvc-runtime DLLs (a runner finds them in its System32).
            extra = {"add_paths": [_vc_runtime()]} if resolve.is_windows_on_linux(target.os) else {}
            repaired = repairmod.repair(result.wheel, dist / "repaired" / target.id, target.os.platform, settings=tc.settings,
                                        machine=target.os.machine if target.os.platform == "linux" else None, log=slog,
                                        **extra)
        with run.stage("tag", log):
            if tagged_dir.exists():
                shutil.rmtree(tagged_dir)
            rec = tag(repaired, target, tagged_dir)
        with run.stage("verify", log) as slog:
            if not skip_verify:
                # Verify against an index of this wheel alone, before it joins dist/.
                vindex = dist / "tagged" / f"{target.id}.index"
                shutil.rmtree(vindex, ignore_errors=True)
                indexmod.write_index([rec], tagged_dir, vindex)
                if is_cross(target.os):  # another machine's wheel: its Python under qemu-user
                    run.verify = verify_emulated(rec, target, matrix, tagged_dir / rec.wheel, vindex, dist, log=slog)
                elif resolve.is_windows_on_linux(target.os):  # a Windows wheel: inspected, loaded under wine
                    from ci.stages.windows_build import verify_windows

                    run.verify = verify_windows(rec, target, tagged_dir / rec.wheel, dist, log=slog)
                else:
                    envs = resolve.verify_envs(rec, verify_pythons, torch_spec=resolve.torch_spec(target), log=slog)
                    run.verify = verifymod.verify(rec, vindex, envs, log=slog)
                shutil.rmtree(vindex, ignore_errors=True)
        with run.stage("index", log):
            wheels = dist / "wheels"
            wheels.mkdir(parents=True, exist_ok=True)
            final = wheels / rec.wheel
            for old in replaced_wheels(wheels, target, rec.wheel):
                old.unlink()
                record_path(old).unlink(missing_ok=True)
            shutil.copy2(tagged_dir / rec.wheel, final)
            shutil.copy2(record_path(tagged_dir / rec.wheel), record_path(final))
            _rebuild_index(dist)
        run.wheel = final
    except Exception as e:  # reported per target; nothing of it reached dist/wheels
        run.error = f"{type(e).__name__}: {e}"
        with run.full_log.open("a", encoding="utf-8") as f:
            f.write(f"{run.failed_stage or 'a'} stage failed:\n" + "".join(traceback.format_exc()))
    finally:
        shutil.rmtree(tagged_dir, ignore_errors=True)
    return run


def replaced_wheels(wheels: Path, target: Target, new: str) -> list[Path]:
    """The earlier wheels of ``target`` in ``wheels`` that ``new`` replaces: its variant on its own
    OS and machine (the x86_64, aarch64 and Windows wheels of one variant live side by side)."""
    out = []
    for wheel in sorted(wheels.glob("sageattn3-*.whl")):
        beside = record_path(wheel)
        named = json.loads(beside.read_text()).get("target") if beside.exists() else None
        # A wheel without its record is of an older factory: replaced when its variant and tags match.
        same = named == target.id if named else wheel.name.split("-", 2)[-1] == new.split("-", 2)[-1]
        if same and wheel.name != new:
            out.append(wheel)
    return out


def _vc_runtime() -> Path:
    from ci.toolchain.windows_toolchain import vc_runtime

    return vc_runtime()


def verify_emulated(rec: BuildRecord, target: Target, matrix: Matrix, wheel: Path, index_dir: Path, dist: Path,
                    log=default_log) -> verifymod.VerifyReport:
    """The verify stage of a cross-built wheel (``ci.stages.emulate``): its report is kept as
    ``dist/verify/<target>.verify.json`` for the evidence (``python -m ci coverage --record``)."""
    from ci.stages import emulate
    from ci.toolchain.torch_source import foreign_line

    foreign = foreign_line(target, matrix, crossmod.TARGET_PYTHON)
    rep = emulate.verify(rec, wheel, index_dir, target.os.machine, torch_requirement=f"torch=={target.build_torch}",
                         foreign_requirement=f"torch=={foreign}", log=log)
    missing = sorted(set(rec.archs) - set(rep.cubins))
    if missing:
        raise emulate.EmulationError(f"{rec.wheel}: no cubin for {missing} in its extension (found {rep.cubins})")
    out = dist / "verify"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{target.id}.verify.json").write_text(json.dumps({"target": target.id, **rep.to_dict()}, indent=2) + "\n")
    where = f"{rep.python} (linux-{rep.machine} under qemu-user)"
    return verifymod.VerifyReport(rec.wheel, [where], rep.abi_guard,
                                  [f"{len(rep.ops)} ops registered; cubins {' '.join(rep.cubins)}; torch {rep.torch}"])


def _rebuild_index(dist: Path) -> None:
    out = dist / "index"
    shutil.rmtree(out, ignore_errors=True)
    indexmod.write_index(load_records(dist / "wheels"), dist / "wheels", out)


def summary_table(runs: list[TargetRun]) -> str:
    stages = ["plan", "build", "repair", "tag", "verify", "index"]
    head = ["target", "wheel", "size", *stages, "result"]
    rows = []
    for r in runs:
        size = f"{r.wheel.stat().st_size / 1e6:.2f} MB" if r.wheel else "-"
        rows.append([r.target.id, r.wheel.name if r.wheel else "-", size,
                     *[f"{r.timings[s]:.1f}s" if s in r.timings else "-" for s in stages],
                     "ok" if not r.error else "FAILED"])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    fmt = lambda row: "  ".join(str(x).ljust(w) for x, w in zip(row, widths))  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths]), *map(fmt, rows)])


def install_hint(dist: Path, runs: list[TargetRun]) -> list[str]:
    lines = []
    for r in runs:
        if not r.wheel:
            continue
        rec = BuildRecord.load(record_path(r.wheel))
        line = r.target.torch_lines[-1]
        page = (dist / "index").resolve() / indexmod.index_url("", rec.cuda, line).lstrip("/")
        lines.append(f"pip install --no-deps sageattn3 --index-url {page.as_uri()}/")
    return lines


def build_test_wheel(target: Target, matrix: Matrix, dist: Path, *, force_patches: tuple[str, ...] = (),
                     log=default_log) -> Path:
    """The test flavour of a target (sm_90a added, FP4 MMA modelled) into dist/test/, repaired
    and recorded, outside dist/wheels and the index: for running GPU tests on Hopper.
    ``force_patches``: patches applied whatever their predicate (e.g. the MSVC one, for its GPU
    test on Linux)."""
    tc = resolve.resolve_toolchain(target, matrix, force_patches=force_patches, mma_model=True)
    result = buildmod.build(tc, matrix, dist / "raw" / f"{target.id}-test", log=log)
    out = dist / "test"
    repaired = repairmod.repair(result.wheel, out, target.os.platform, settings=tc.settings, log=log)
    rec = BuildRecord.from_dict(read_record_in_wheel(repaired)).with_wheel(repaired)
    record_path(repaired).write_text(rec.to_json())
    log(f"test-flavour wheel: {repaired}")
    return repaired


# Imports the wheel and reports, for every op its extension must register from C++ (the package's
# own lists, sageattn3._kernels.OUTPUT_WRITING_OPS and ALLOCATING_OPS, which a test ties to
# csrc/torch/ops.h), whether the dispatcher has a CUDA kernel for it.
PROOF_PROBE = (
    "import json, torch, sageattn3; from sageattn3 import _kernels;"
    "has = lambda n: torch._C._dispatch_has_kernel_for_dispatch_key('sageattn3::' + n, 'CUDA');"
    "names = [*_kernels.OUTPUT_WRITING_OPS, *_kernels.ALLOCATING_OPS];"
    "print(json.dumps({'record': sageattn3.build_info(),"
    " 'ops': [n for n in names if has(n)],"
    " 'missing': [n for n in names if not has(n)]}))"
)


@dataclass
class ProofReport:
    wheel: Path
    own_torch: str
    ops: list[str]
    guard: dict[str, str]  # foreign torch version -> the first line of its ImportError


def build_proof_wheel(target: Target, matrix: Matrix, dist: Path, *, foreign: list[Target] | None = None,
                      force_patches: tuple[str, ...] = (), log=default_log) -> ProofReport:
    """The proof flavour of a per-torch target (see ci.stages.build.PROOF_CUDA): build, repair, tag into
    dist/proof/ (never indexed or published), then install it with real pip into a fresh venv
    holding the target's own torch and import it there with no GPU (the dynamic loader resolves
    every symbol of _C at import); then into venvs with the torch of each ``foreign`` target,
    where the ABI guard must refuse it with its message. ``force_patches``: as for the other
    flavours, patches applied whatever their predicate."""
    from ci.toolchain import torch_source as torch_sources

    if target.variant.stable:
        raise buildmod.BuildError(f"{target.id}: the proof flavour is for per-torch targets")
    tc = resolve.resolve_toolchain(target, matrix, force_patches=force_patches, proof=True)
    result = buildmod.build(tc, matrix, dist / "raw" / f"{target.id}-proof", log=log)
    repaired = repairmod.repair(result.wheel, dist / "repaired" / f"{target.id}-proof", target.os.platform,
                                settings=tc.settings, log=log)
    out = dist / "proof"
    for old in out.glob(f"sageattn3-*+{target.variant.label}.{PROOF_FLAVOUR_LABEL}-*.whl*"):
        old.unlink()
    # Tagged beside, moved into dist/proof/ (where evidence is read from) only once every check passed.
    pending = dist / "tagged" / f"{target.id}-proof"
    shutil.rmtree(pending, ignore_errors=True)
    rec = tag(repaired, target, pending, flavour=PROOF_FLAVOUR_LABEL)
    wheel = pending / rec.wheel
    env_vars = pip_environ(sources=False, extra={"CUDA_VISIBLE_DEVICES": ""})
    with tempfile.TemporaryDirectory(prefix="sageattn3-proof-") as tmp:
        vpy = verifymod.make_venv_with(result.env, Path(tmp) / "own")
        pip = [str(vpy), "-m", "pip", "install", "--no-deps", "--no-index", "--quiet", str(wheel)]
        subprocess.run(pip, check=True, env=env_vars)
        res = subprocess.run([str(vpy), "-c", PROOF_PROBE], capture_output=True, text=True, env=env_vars)
        if res.returncode != 0:
            raise buildmod.BuildError(f"{wheel.name}: import into torch {result.env.torch_version} failed:\n{res.stderr[-3000:]}")
        got = json.loads(res.stdout.strip().splitlines()[-1])
        if got["missing"] or not got["ops"]:
            raise buildmod.BuildError(f"{wheel.name}: ops without a CUDA kernel after import: {got['missing']}")
        if got["record"].get("target") != target.id:
            raise buildmod.BuildError(f"{wheel.name}: imported build record names {got['record'].get('target')}")
        log(f"[proof] {wheel.name}: imports into torch {result.env.torch_version} without a GPU; ops {', '.join(got['ops'])}")
        guard = {}
        for other in foreign or []:
            fenv = torch_sources.torch_env_for(resolve.build_python(other, tc.settings), torch_sources.torch_source(other))
            fpy = verifymod.make_venv_with(fenv, Path(tmp) / f"foreign-{other.id}")
            subprocess.run([str(fpy), "-m", "pip", "install", "--no-deps", "--no-index", "--quiet", str(wheel)],
                           check=True, env=env_vars)
            res = subprocess.run([str(fpy), "-c", "import sageattn3"], capture_output=True, text=True, env=env_vars)
            lines = [ln for ln in res.stderr.splitlines() if "TorchMismatchError" in ln]
            if res.returncode == 0 or not lines or "undefined symbol" in res.stderr:
                raise buildmod.BuildError(f"{wheel.name}: imported into torch {fenv.torch_version} without the "
                                          f"ABI guard's ImportError:\n{res.stderr[-2000:]}")
            guard[fenv.torch_version] = lines[-1]
            log(f"[proof] torch {fenv.torch_version}: {lines[-1][:240]}")
    out.mkdir(parents=True, exist_ok=True)
    for f in (wheel, record_path(wheel)):
        shutil.move(str(f), out / f.name)
    shutil.rmtree(pending, ignore_errors=True)
    return ProofReport(out / wheel.name, result.env.torch_version, got["ops"], guard)


def build_wheels(targets: list[Target], matrix: Matrix, dist: Path, *, verify_pythons: list[str],
                 skip_verify: bool = False, force_patches: tuple[str, ...] = (), log=default_log) -> list[TargetRun]:
    runs = []
    for t in targets:
        log(f"== {t.describe()}")
        run = run_target(t, matrix, dist, verify_pythons=verify_pythons, skip_verify=skip_verify,
                         force_patches=force_patches, log=log)
        if run.error:
            where = run.log_path if run.log_path and run.log_path.exists() and run.failed_stage == "build" else None
            log(f"!! {t.id}: {run.failed_stage or 'a'} stage failed: {run.error}"
                + (f"\n!! {t.id}: full build log: {where}" if where else "")
                + f"\n!! {t.id}: the factory's log of this target (every stage, the traceback): {run.full_log}")
        runs.append(run)
    log("\n" + summary_table(runs))
    for r in runs:
        if r.log_path and r.log_path.exists():
            log(f"full build log of {r.target.id}: {r.log_path}")
        if r.full_log and r.full_log.exists():
            log(f"factory log of {r.target.id} (every stage): {r.full_log}")
    for r in runs:
        if r.verify:
            log(f"verified {r.verify.wheel} on Python {', '.join(r.verify.pythons)}; ABI guard: {r.verify.abi_guard}")
    hints = install_hint(dist, runs)
    if hints:
        log("\nInstall with (torch already installed; pip will not touch it):")
        for h in hints:
            log("    " + h)
    sys.stdout.flush()
    return runs
