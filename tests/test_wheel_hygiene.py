"""Wheel hygiene at every door (ci.stages.wheel_hygiene, through ci.stages.record.check_wheel): each doctored
wheel — an unsafe member, a member outside the project's folders, a duplicate member, a file
name the factory does not write, a second wheel shadowing the real one — is refused by gather,
``publish github``, the index and ``publish pypi`` (upload-index) with exit status 2 and one
line naming the wheel and the member, before any request and before anything is written. The
command lines run for real (in this process, or as a subprocess for gather); the servers are
real HTTP servers on 127.0.0.1 that count what reaches them."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from ci import index as ix
from ci.release.publish.__main__ import main as publish_main
from ci.stages.record import RECORD_IN_WHEEL, BuildRecord, load_records, record_path
from ci.stages.wheel_hygiene import check_distinct, check_name
from conftest_publish import REPO, Venv, rewrite_wheel, sage_wheel, serve_dir
from ci.release.github_standin import GitHubStandin

pytestmark = pytest.mark.timeout(180)

TOKEN = "ghp_" + "h" * 36
FULL = "octo/sageattn3"
TARGET = "test-cu130-torch2.10"  # what conftest_publish.sage_wheel records for VARIANT
VARIANT = "cu130.torch2.10.stable"


def _resync(wheel: Path, **fields) -> None:
    """The beside-record brought up to date with the (doctored) file, so only the doctored part
    is wrong."""
    d = json.loads(BuildRecord.load(record_path(wheel)).with_wheel(wheel).to_json())
    d.update(fields)
    record_path(wheel).write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")


def _member(member: str):
    def doctor(w: Path) -> list[Path]:
        rewrite_wheel(w, {member: b"import os; os.system('echo owned')\n"})
        _resync(w)
        return [w]
    doctor.__name__ = f"member {member}"
    return doctor


def doctor_duplicate_member(w: Path) -> list[Path]:
    """A second entry under an existing name (RECORD lists it once): installers keep one."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns about the duplicate it is asked to write
        with zipfile.ZipFile(w, "a") as z:
            z.writestr("sageattn3/__init__.py", b"VARIANT = 'evil'\n")
    _resync(w)
    return [w]


def doctor_case_duplicate(w: Path) -> list[Path]:
    rewrite_wheel(w, {"sageattn3/__INIT__.py": b"x = 1\n"})
    _resync(w)
    return [w]


def _renamed(w: Path, name: str) -> Path:
    new = w.rename(w.with_name(name))
    record_path(w).rename(record_path(new))
    _resync(new)
    return new


def doctor_case_variant_project(w: Path) -> list[Path]:
    """The real wheel and a copy named SageAttn3-...: pip treats both as one project."""
    copy = w.with_name("SageAttn3" + w.name[len("sageattn3"):])
    shutil.copy2(w, copy)
    shutil.copy2(record_path(w), record_path(copy))
    _resync(copy)
    return [w, copy]


def doctor_build_tag(w: Path) -> list[Path]:
    """The real wheel and a copy with build tag 1: pip picks the copy (a higher build tag wins)."""
    parts = w.name.split("-")
    copy = w.with_name("-".join(parts[:2] + ["1"] + parts[2:]))
    shutil.copy2(w, copy)
    shutil.copy2(record_path(w), record_path(copy))
    _resync(copy)
    return [w, copy]


def doctor_duplicate_tags(w: Path) -> list[Path]:
    """A second wheel of the same version under another name whose tags include the real
    one's (a compressed tag set): everything about it is consistent but that."""
    parts = w.name[:-4].split("-")
    plat = parts[4]
    copy = w.parent / "tmp" / w.name
    copy.parent.mkdir()
    shutil.copy2(w, copy)
    info = f"{parts[0]}-{parts[1]}.dist-info"
    tags = f"Tag: {parts[2]}-{parts[3]}-{plat}\nTag: {parts[2]}-{parts[3]}-manylinux_2_28_x86_64\n"
    name = "-".join(parts[:4] + [f"{plat}.manylinux_2_28_x86_64"]) + ".whl"
    new = rewrite_wheel(copy, {f"{info}/WHEEL": f"Wheel-Version: 1.0\nGenerator: x\nRoot-Is-Purelib: false\n{tags}"
                               .encode()}, new_name=name)
    shutil.copy2(record_path(w), record_path(w.parent / name))
    new = shutil.move(str(new), str(w.parent / name))
    shutil.rmtree(copy.parent)
    _resync(Path(new))
    return [w, Path(new)]


def _retagged(python: str | None = None, platform: str | None = None):
    """The real wheel and a consistent copy under other tags of the same platform (another
    Python tag, or an older manylinux): pip on a machine both fit picks one of them."""
    def doctor(w: Path) -> list[Path]:
        parts = w.name[:-4].split("-")
        py, plat = python or parts[2], platform or parts[4]
        name = "-".join(parts[:2] + [py, parts[3], plat]) + ".whl"
        info = f"{parts[0]}-{parts[1]}.dist-info"
        work = w.parent / "tmp"
        work.mkdir()
        shutil.copy2(w, work / w.name)
        new = rewrite_wheel(work / w.name, {f"{info}/WHEEL": f"Wheel-Version: 1.0\nGenerator: x\nRoot-Is-Purelib: "
                                            f"false\nTag: {py}-{parts[3]}-{plat}\n".encode()}, new_name=name)
        dest = Path(shutil.move(str(new), str(w.parent / name)))
        shutil.copy2(record_path(w), record_path(dest))
        shutil.rmtree(work)
        _resync(dest)
        return [w, dest]
    doctor.__name__ = f"shadow {python or platform}"
    return doctor


def doctor_lone_python_tag(w: Path) -> list[Path]:
    """Only the cp311 copy, the real wheel gone: a consistent wheel with a Python tag the
    factory never gives a floor of 3.10."""
    _, dest = _retagged(python="cp311")(w)
    w.unlink()
    record_path(w).unlink()
    return [dest]


DOCTORS = [
    (_member("../evil.pth"), "'../evil.pth': a '..' segment"),
    (_member("/tmp/evil.pth"), "'/tmp/evil.pth': an absolute path"),
    (_member("sageattn3/../../../../tmp/x"), "'sageattn3/../../../../tmp/x': a '..' segment"),
    (_member("sageattn3\\evil.py"), "'sageattn3\\\\evil.py': a backslash"),
    (_member("C:/evil.py"), "'C:/evil.py': a drive letter"),
    (_member("sageattn3/./x.py"), "'sageattn3/./x.py': an empty or '.' segment"),
    (_member("evil.pth"), "'evil.pth': outside the project's own folders"),
    (_member("sageattn3-0.1.0+cu130.torch2.10.stable.data/scripts/evil"), "outside the project's own folders"),
    (doctor_duplicate_member, "'sageattn3/__init__.py': 2 entries of the same name"),
    (doctor_case_duplicate, "'sageattn3/__INIT__.py': the same name as 'sageattn3/__init__.py' but for case"),
    (doctor_case_variant_project, "file name: project 'SageAttn3', the factory writes 'sageattn3'"),
    (doctor_build_tag, "file name: build tag '1'"),
    (doctor_duplicate_tags, "the same project and version (0.1.0+cu130.torch2.10.stable) for the same platform"),
    (_retagged(python="cp311"), "the file name's Python tag (the factory tags a wheel cpXY for its floor"),
    (_retagged(platform="manylinux_2_17_x86_64"), "for the same platform (linux_x86_64)"),
    (doctor_lone_python_tag, "requires_python: the beside-record says '>=3.10', the file name's Python tag"),
    (_member("sageattn3/__init__.py:evil"), "'sageattn3/__init__.py:evil': a ':' in its path"),
    (_member("sageattn3/__init__.py."), "'sageattn3/__init__.py.': a path segment ending in '.'"),
    (_member("sageattn3/CON.py"), "'sageattn3/CON.py': a reserved Windows device name"),
]
IDS = [d.__name__ for d, _ in DOCTORS]


@pytest.fixture
def wheels(tmp_path) -> Path:
    d = tmp_path / "wheels"
    sage_wheel(d, VARIANT, "0.1.0", platform="linux_x86_64")
    sage_wheel(d, "cu128.torch2.8", "0.1.0", platform="linux_x86_64")
    return d


def _refused(rc: int, err: str, needle: str) -> None:
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err and "unexpected" not in err, err
    assert needle in lines[0], (needle, lines[0])


@pytest.mark.parametrize("doctor,needle", DOCTORS, ids=IDS)
def test_publish_index_and_upload_index_refuse_it_before_any_request(wheels, tmp_path, capsys, monkeypatch,
                                                                     doctor, needle):
    doctor(next(wheels.glob(f"*+{VARIANT}-*.whl")))
    monkeypatch.setenv("GITHUB_TOKEN", TOKEN)
    with GitHubStandin(TOKEN) as gh:
        gh.add_repo(FULL)
        for extra in ([], ["--dry-run"]):
            rc = publish_main(["github", "--tag", "v0.1.0", "--repo", FULL, "--wheels", str(wheels), "--api-url",
                               gh.api_url, "--write-interval", "0", *extra])
            _refused(rc, capsys.readouterr().err, needle)
        assert gh.count() == 0
    out = tmp_path / "idx"
    rc = ix.main(["build", "--wheels", str(wheels), "--out", str(out)])
    _refused(rc, capsys.readouterr().err, needle)
    assert not out.exists()
    site = tmp_path / "pypi"
    site.mkdir()
    with serve_dir(site) as url:
        for mode in ("--all-variants", "--pypi"):
            rc = publish_main(["pypi", "--repository-url", url, "--wheels", str(wheels), mode,
                               "--default-variant", VARIANT, "--out", str(tmp_path / "derived")])
            _refused(rc, capsys.readouterr().err, needle)
        assert url.requested == []
    assert not (tmp_path / "derived").exists()


def _retarget(w: Path, target: str) -> None:
    """The wheel's records (inside and beside) say ``target``."""
    with zipfile.ZipFile(w) as z:
        inner = json.loads(z.read(RECORD_IN_WHEEL))
    inner["target"] = target
    rewrite_wheel(w, {RECORD_IN_WHEEL: json.dumps(inner).encode()})
    _resync(w)
    d = json.loads(record_path(w).read_text())
    d["target"] = target
    record_path(w).write_text(json.dumps(d))


def _artifact(w: Path, root: Path, target: str) -> None:
    """The build job's artifact directory for ``target``: the wheel and its record."""
    d = root / f"wheel-{target}"
    d.mkdir(parents=True)
    shutil.copy2(w, d / w.name)
    shutil.copy2(record_path(w), record_path(d / w.name))


def _gather(plan: dict, artifacts: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ci.release", "gather", "--plan", json.dumps(plan), "--artifacts",
                           str(artifacts), "--out", str(out), *extra], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


PLAN = {"include": [{"id": TARGET, "variant": VARIANT}]}


@pytest.mark.parametrize("doctor,needle", DOCTORS, ids=IDS)
def test_gather_refuses_it_and_copies_nothing(wheels, tmp_path, doctor, needle):
    made = doctor(next(wheels.glob(f"*+{VARIANT}-*.whl")))
    arts = tmp_path / "artifacts"
    _artifact(made[0], arts, TARGET)
    plan = PLAN
    if len(made) == 2:  # the shadowing copy as the artifact of a second planned target
        other = TARGET + "-x"
        _retarget(made[1], other)
        _artifact(made[1], arts, other)
        plan = {"include": [*PLAN["include"], {"id": other, "variant": VARIANT}]}
    p = _gather(plan, arts, tmp_path / "out")
    _refused(p.returncode, p.stderr, needle)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_the_untouched_wheels_pass_every_door(wheels, tmp_path, capsys):
    """The premise: without the doctoring, the same wheels go through (so each refusal above is
    the doctored part's)."""
    assert len(load_records(wheels)) == 2
    assert ix.main(["build", "--wheels", str(wheels), "--out", str(tmp_path / "idx")]) == 0
    _artifact(next(wheels.glob(f"*+{VARIANT}-*.whl")), tmp_path / "artifacts", TARGET)
    p = _gather(PLAN, tmp_path / "artifacts", tmp_path / "out")
    assert p.returncode == 0 and "gathered 1 wheel(s)" in p.stdout, p.stderr


def test_the_index_refuses_a_wheel_that_shadows_one_it_already_serves(wheels, tmp_path):
    """A later merge: the index holds the real wheel; a build-tagged or re-tagged copy arriving
    in another run is refused, and the index is left as it was."""
    out = tmp_path / "idx"
    ix.write_index(load_records(wheels), wheels, out)
    before = (out / "index.json").read_bytes()
    real = next(wheels.glob(f"*+{VARIANT}-*.whl"))
    later = tmp_path / "later"
    later.mkdir()
    for p in (real, record_path(real)):
        shutil.copy2(p, later / p.name)
    _, shadow = doctor_duplicate_tags(later / real.name)
    (later / real.name).unlink()
    record_path(later / real.name).unlink()
    with pytest.raises(ix.IndexError_, match=r"the same project and version .* for the same platform .* as .*already in"):
        ix.write_index(load_records(later), later, out)
    assert (out / "index.json").read_bytes() == before


def test_pip_installs_the_build_tagged_copy_over_the_real_wheel(wheels, tmp_path):
    """Why a build tag is refused: given both, real pip picks the copy."""
    real = next(wheels.glob(f"*+{VARIANT}-*.whl"))
    rewrite_wheel(real, {"sageattn3/__init__.py": b"VARIANT = 'real'\n"})
    parts = real.name.split("-")
    links = tmp_path / "links"
    links.mkdir()
    shutil.copy2(real, links / real.name)
    copy = links / "-".join(parts[:2] + ["1"] + parts[2:])
    shutil.copy2(real, copy)
    rewrite_wheel(copy, {"sageattn3/__init__.py": b"VARIANT = 'tampered'\n"})
    venv = Venv(tmp_path / "venv")
    venv.pip("install", "--no-deps", "--no-index", "--find-links", str(links), "sageattn3")
    assert venv.run("import sageattn3; print(sageattn3.VARIANT)") == "tampered"
    with pytest.raises(Exception, match="build tag '1'"):
        check_name(copy.name, "sageattn3")


def test_names_and_sets_the_factory_writes_pass():
    name = "sageattn3-0.1.0+cu130.torch2.10.stable-cp310-abi3-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl"
    assert check_name(name, "sageattn3").dist_info == "sageattn3-0.1.0+cu130.torch2.10.stable.dist-info"
    check_distinct([name, name.replace("x86_64", "aarch64"), name.replace("cu130", "cu128")])
    with pytest.raises(ValueError, match="normal form"):
        check_name(name.replace("0.1.0", "0.01.0"), "sageattn3")
    with pytest.raises(ValueError, match="5 "):
        check_name("sageattn3-0.1.0-py3-none.whl", "sageattn3")
