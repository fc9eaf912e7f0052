"""What publishing and the index refuse before anything is sent or written: a tag that is not
v + the wheels' version, a repository that is not OWNER/NAME, a missing or empty wheels
directory, and wheels that disagree with their beside-records (the doctored-wheel case). Each
is one line on stderr naming the file and the field, exit status 2, no request to the
(loopback) GitHub server and no index written. The command lines run in this process."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from ci import index as ix
from ci.release.publish.__main__ import main as publish_main
from ci.release.publish._net import Redactor, token_from_env
from ci.stages.record import RECORD_IN_WHEEL, BuildRecord, RecordError, check_wheel, load_records, record_path
from conftest_publish import rewrite_wheel, sage_wheel
from ci.release.github_standin import GitHubStandin

pytestmark = pytest.mark.timeout(120)

TOKEN = "ghp_" + "t" * 36
FULL = "octo/sageattn3"


@pytest.fixture
def gh(monkeypatch):
    monkeypatch.setenv("GITHUB_TOKEN", TOKEN)
    with GitHubStandin(TOKEN) as server:
        server.add_repo(FULL)
        yield server


@pytest.fixture
def wheels(tmp_path) -> Path:
    d = tmp_path / "wheels"
    sage_wheel(d, "cu130.torch2.10.stable", "0.1.0", platform="linux_x86_64")
    sage_wheel(d, "cu128.torch2.8", "0.1.0", platform="linux_x86_64")
    return d


def publish(gh: GitHubStandin, capsys, *args: str) -> tuple[int, str, str]:
    # the input checks' own wheels: no build job's outputs vouch for them
    rc = publish_main(["github", "--api-url", gh.api_url, "--write-interval", "0", "--backoff", "0.01",
                       "--allow-local-build", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def index(capsys, *args: str) -> tuple[int, str, str]:
    rc = ix.main(["build", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def assert_refused(rc: int, err: str, *needles: str) -> None:
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err  # one line, no traceback
    assert "unexpected" not in err and "Traceback" not in err
    for n in needles:
        assert n in lines[0], (n, lines[0])


@pytest.mark.parametrize("tag", ["v9.9.9", "not-a-version", "v0.1.0 ", "", "0.1.0", "v0.1.0+cu130.torch2.10.stable",
                                 "v0.1", "v0.1.0rc1", "V0.1.0"])
def test_a_tag_other_than_v_plus_the_version_is_refused_before_any_request(gh, wheels, capsys, tag):
    rc, out, err = publish(gh, capsys, f"--tag={tag}", "--repo", FULL, "--wheels", str(wheels))
    assert_refused(rc, err, f"--tag {tag!r}", "version 0.1.0", "use --tag v0.1.0", ".whl")
    assert gh.count() == 0
    rc, out, err = publish(gh, capsys, f"--tag={tag}", "--repo", FULL, "--wheels", str(wheels), "--dry-run")
    assert rc == 2 and gh.count() == 0


def test_the_right_tag_is_accepted(gh, wheels, capsys):
    rc, out, err = publish(gh, capsys, "--tag", "v0.1.0", "--repo", FULL, "--wheels", str(wheels), "--dry-run")
    assert rc == 0, err
    assert "create   release v0.1.0" in out


def test_wheels_of_two_versions_are_refused(gh, wheels, capsys):
    sage_wheel(wheels, "cu130.torch2.10.stable", "0.2.0")
    rc, out, err = publish(gh, capsys, "--tag", "v0.2.0", "--repo", FULL, "--wheels", str(wheels))
    assert_refused(rc, err, "version", "0.1.0", "0.2.0", "one release holds one version")
    assert gh.count() == 0


@pytest.mark.parametrize("repo", ["notarepo", "octo/", "/sageattn3", "octo/sage/attn3", "octo/sageattn3 ", "octo/..",
                                  "-octo/sageattn3", "octo/sage attn3"])
def test_a_repo_that_is_not_owner_slash_name_is_refused(gh, wheels, capsys, repo):
    rc, out, err = publish(gh, capsys, "--tag", "v0.1.0", f"--repo={repo}", "--wheels", str(wheels))
    assert_refused(rc, err, f"--repo {repo!r}", "OWNER/NAME")
    assert gh.count() == 0
    rc = publish_main(["pages", f"--repo={repo}", "--index", str(wheels), "--api-url", gh.api_url])
    assert rc == 2 and "OWNER/NAME" in capsys.readouterr().err and gh.count() == 0


def test_missing_or_empty_wheels_dir_is_refused(gh, tmp_path, capsys):
    for d in (tmp_path / "typo", tmp_path / "empty"):
        if d.name == "empty":
            d.mkdir()
            (d / "stray.json").write_text("{}")
        rc, out, err = publish(gh, capsys, "--tag", "v0.1.0", "--repo", FULL, "--wheels", str(d))
        assert_refused(rc, err, str(d), "--wheels")
        rc, out, err = index(capsys, "--wheels", str(d), "--out", str(tmp_path / "idx"))
        assert_refused(rc, err, str(d), "--wheels")
    assert gh.count() == 0 and not (tmp_path / "idx").exists()


def test_without_a_token_the_input_is_still_checked_first(gh, wheels, capsys, monkeypatch):
    monkeypatch.delenv("GITHUB_TOKEN")
    monkeypatch.delenv("GH_TOKEN", raising=False)
    rc, out, err = publish(gh, capsys, "--tag", "v9.9.9", "--repo", FULL, "--wheels", str(wheels))
    assert_refused(rc, err, "--tag 'v9.9.9'")
    rc, out, err = publish(gh, capsys, "--tag", "v0.1.0", "--repo", FULL, "--wheels", str(wheels))
    assert rc == 2 and "GITHUB_TOKEN" in err and gh.count() == 0  # bad input: the environment must change
    # a dry run too: a usage error, before any (unauthenticated) request
    rc, out, err = publish(gh, capsys, "--tag", "v0.1.0", "--repo", FULL, "--wheels", str(wheels), "--dry-run")
    assert_refused(rc, err, "no GitHub token", "GITHUB_TOKEN or GH_TOKEN")
    assert gh.count() == 0 and "plan for release" not in out


# -- wheels that disagree with their beside-records -----------------------------------------

def _edit_record(whl: Path, **fields) -> None:
    rp = record_path(whl)
    d = json.loads(rp.read_text())
    d.update(fields)
    rp.write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")


def _resync(wheel: Path) -> None:
    """Beside-record's wheel/sha256/size updated to the (doctored) file: only the doctored
    part disagrees."""
    rec = BuildRecord.load(record_path(wheel)).with_wheel(wheel)
    record_path(wheel).write_text(rec.to_json())


def _info(wheel: Path) -> str:
    return wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1] + ".dist-info"


def doctor_renamed_to_windows_cu132(w: Path) -> Path:
    """The issue's case: a Linux cu130 wheel renamed to +cu132 ... win_amd64, its record edited
    to match the new name (sha256 and size are the file's own)."""
    name = w.name.replace("+cu130.", "+cu132.").replace("linux_x86_64", "win_amd64")
    new = w.rename(w.with_name(name))
    record_path(w).rename(record_path(new))
    _edit_record(new, wheel=name, version="0.1.0+cu132.torch2.10.stable", variant="cu132.torch2.10.stable",
                 cuda="13.2", os="windows-amd64")
    return new


def doctor_metadata_version(w: Path) -> Path:
    meta = (f"Metadata-Version: 2.1\nName: sageattn3\nVersion: 0.1.1+cu130.torch2.10.stable\n"
            "Requires-Python: >=3.10\nRequires-Dist: torch>=2.10\n\n").encode()
    rewrite_wheel(w, {f"{_info(w)}/METADATA": meta})
    _resync(w)
    return w


def doctor_wheel_tag(w: Path) -> Path:
    rewrite_wheel(w, {f"{_info(w)}/WHEEL": b"Wheel-Version: 1.0\nGenerator: x\nRoot-Is-Purelib: false\n"
                                           b"Tag: cp310-abi3-win_amd64\n"})
    _resync(w)
    return w


def doctor_inner_record(w: Path) -> Path:
    import zipfile

    with zipfile.ZipFile(w) as z:
        inner = json.loads(z.read(RECORD_IN_WHEEL))
    inner["archs"] = ["sm_90a"]
    rewrite_wheel(w, {RECORD_IN_WHEEL: json.dumps(inner).encode()})
    _resync(w)
    return w


def doctor_no_inner_record(w: Path) -> Path:
    rewrite_wheel(w, {RECORD_IN_WHEEL: None})
    _resync(w)
    return w


def doctor_beside_field(w: Path) -> Path:
    _edit_record(w, source_commit="f" * 40)
    return w


def doctor_beside_sha256(w: Path) -> Path:
    _edit_record(w, sha256="0" * 64)
    return w


def doctor_beside_not_json(w: Path) -> Path:
    record_path(w).write_text("{not json")
    return w


def doctor_beside_missing_field(w: Path) -> Path:
    d = json.loads(record_path(w).read_text())
    del d["target"]
    record_path(w).write_text(json.dumps(d))
    return w


def doctor_requires_torch(w: Path) -> Path:
    _edit_record(w, requires_torch="torch>=2.12")
    rewrite_wheel(w, {})  # unchanged content
    return w


def _repack(w: Path, change) -> None:
    """The wheel's members rewritten through ``change(name, bytes) -> bytes | None`` (None drops
    the member), its RECORD left as it was."""
    import zipfile

    with zipfile.ZipFile(w) as z:
        content = {n: z.read(n) for n in z.namelist()}
    tmp = w.with_name(w.name + ".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
        for n, b in content.items():
            b = change(n, b)
            if b is not None:
                z.writestr(n, b)
    tmp.replace(w)


def doctor_payload_byte(w: Path) -> Path:
    """The issue's case: one byte of the payload changed inside the wheel, the beside-record's
    sha256 and size brought up to date, the wheel's own RECORD not."""
    def flip(n: str, b: bytes) -> bytes:
        return bytes([b[0] ^ 1]) + b[1:] if n == "sageattn3/__init__.py" else b
    _repack(w, flip)
    _resync(w)
    return w


def doctor_unlisted_member(w: Path) -> Path:
    """A file slipped into the wheel that its RECORD does not list."""
    _repack(w, lambda n, b: b)
    import zipfile

    with zipfile.ZipFile(w, "a") as z:
        z.writestr("sageattn3/_extra.so", b"\x7fELF")
    _resync(w)
    return w


def doctor_listed_member_dropped(w: Path) -> Path:
    _repack(w, lambda n, b: None if n == "sageattn3/__init__.py" else b)
    _resync(w)
    return w


@pytest.mark.parametrize("doctor,field", [
    (doctor_payload_byte, "RECORD: sageattn3/__init__.py: its bytes hash to"),
    (doctor_unlisted_member, "RECORD: sageattn3/_extra.so is in the wheel but not in its RECORD"),
    (doctor_listed_member_dropped, "RECORD: lists sageattn3/__init__.py"),
    (doctor_renamed_to_windows_cu132, ".dist-info"),
    (doctor_metadata_version, "METADATA Version"),
    (doctor_wheel_tag, "WHEEL Tag"),
    (doctor_inner_record, "archs"),
    (doctor_no_inner_record, RECORD_IN_WHEEL),
    (doctor_beside_field, "source_commit"),
    (doctor_beside_sha256, "sha256"),
    (doctor_beside_not_json, "not a readable JSON build record"),
    (doctor_beside_missing_field, "field target"),
    (doctor_requires_torch, "requires_torch"),
], ids=lambda x: getattr(x, "__name__", x))
def test_a_doctored_wheel_is_refused_by_publish_and_by_the_index(gh, wheels, capsys, tmp_path, doctor, field):
    victim = doctor(next(wheels.glob("*+cu130.*.whl")))
    rc, out, err = publish(gh, capsys, "--tag", "v0.1.0", "--repo", FULL, "--wheels", str(wheels))
    assert_refused(rc, err, victim.name if not field.startswith("not a readable") else record_path(victim).name, field)
    assert gh.count() == 0
    out_dir = tmp_path / "idx"
    rc, out, err = index(capsys, "--wheels", str(wheels), "--out", str(out_dir))
    assert_refused(rc, err, field)
    assert not out_dir.exists()  # nothing written


def test_the_index_api_refuses_a_doctored_wheel_and_writes_nothing(wheels, tmp_path):
    """The pipeline hands records to the index directly: the same check applies there."""
    good = BuildRecord.load(record_path(next(wheels.glob("*+cu128.*.whl"))))
    victim = doctor_renamed_to_windows_cu132(next(wheels.glob("*+cu130.*.whl")))
    bad = BuildRecord.load(record_path(victim))
    out = tmp_path / "idx"
    with pytest.raises(ix.IndexError_, match=r"win_amd64\.whl: member '[^']+\.dist-info/METADATA': a \.dist-info folder other than"):
        ix.write_index([good, bad], wheels, out)
    assert not out.exists()


def test_index_cli_errors_are_one_line_with_their_own_status(wheels, tmp_path, capsys):
    out = tmp_path / "idx"
    assert index(capsys, "--wheels", str(wheels), "--out", str(out))[0] == 0
    cases = [
        (["--wheels", str(wheels), "--out", str(out), "--remove", "9.9.9"], "--remove '9.9.9'"),
        (["--out", str(out), "--yank", "nonsense"], "WHEEL=REASON"),
        (["--out", str(out), "--yank", "sageattn3-0.0.1-cp310-abi3-linux_x86_64.whl=x"], "not an indexed wheel"),
    ]
    for args, needle in cases:
        rc, _, err = index(capsys, *args)
        assert_refused(rc, err, needle)
    (out / "index.json").write_text('{"format": 99}')
    rc, _, err = index(capsys, "--wheels", str(wheels), "--out", str(out))
    assert_refused(rc, err, "manifest format")
    rc = ix.main(["check", str(tmp_path / "nowhere")])
    err = capsys.readouterr().err
    assert rc == 2 and "cannot read an index" in err and "Traceback" not in err
    rc = ix.main(["which", "--torch", "2.14.1+cu130"])
    err = capsys.readouterr().err
    assert rc == 2 and "python -m sageattn3 which" in err and "index.html" in err


# -- what the server refuses, and options that cannot be right ------------------------------

def assert_failed(rc: int, err: str, *needles: str) -> None:
    """A failure the input could not show: one line, exit status 1, never "unexpected"."""
    assert rc == 1, err
    assert len(err.strip().splitlines()) == 1 and "unexpected" not in err and "Traceback" not in err, err
    for n in needles:
        assert n in err, (n, err)


def test_a_refused_token_or_a_missing_repository_says_what_to_check(gh, wheels, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("GITHUB_TOKEN", "ghp_" + "x" * 36)  # not the server's token
    rc, out, err = publish(gh, capsys, "--tag", "v0.1.0", "--repo", FULL, "--wheels", str(wheels))
    assert_failed(rc, err, "octo/sageattn3: list releases: HTTP 401", "token in GITHUB_TOKEN or GH_TOKEN was refused")
    n = gh.count()
    assert n == 1  # asked once: no retry can change a 401
    monkeypatch.setenv("GITHUB_TOKEN", TOKEN)
    rc, out, err = publish(gh, capsys, "--tag", "v0.1.0", "--repo", "octo/missing", "--wheels", str(wheels))
    assert_failed(rc, err, "octo/missing: list releases: HTTP 404", "check that --repo names an existing repository")
    idx = tmp_path / "idx"
    ix.write_index(load_records(wheels), wheels, idx)
    rc = publish_main(["pages", "--repo", "octo/missing", "--index", str(idx), "--api-url", gh.api_url])
    assert_failed(rc, capsys.readouterr().err, "octo/missing: read the repository: HTTP 404", "--repo")
    assert sum(gh.count(m) for m in ("POST", "PATCH", "DELETE", "PUT")) == 0


@pytest.mark.parametrize("url", ["notaurl", "api.github.com", "ftp://api.github.com", "https://", "file:///tmp/x"])
def test_an_api_url_that_is_not_http_is_refused(gh, wheels, capsys, tmp_path, url):
    rc, out, err = publish(gh, capsys, "--tag", "v0.1.0", "--repo", FULL, "--wheels", str(wheels), f"--api-url={url}")
    assert_refused(rc, err, f"--api-url {url!r}", "https://api.github.com")
    idx = tmp_path / "idx"
    ix.write_index(load_records(wheels), wheels, idx)
    rc = publish_main(["pages", "--repo", FULL, "--index", str(idx), f"--api-url={url}"])
    assert_refused(rc, capsys.readouterr().err, f"--api-url {url!r}")
    assert gh.count() == 0


def test_the_redactor_strips_the_token_as_the_publisher_does(monkeypatch):
    """A token pasted with a newline is sent stripped: that stripped value is what must never
    be printed."""
    monkeypatch.setenv("GITHUB_TOKEN", f" {TOKEN}\n")
    monkeypatch.setenv("TWINE_PASSWORD", "pypi-secret-value\n")
    assert token_from_env() == TOKEN
    redact = Redactor.from_env()
    assert redact(f"Authorization: token {TOKEN}; password pypi-secret-value.") == "Authorization: token ***; password ***."


# -- flavours that are never shipped, and records that change under an indexed wheel ---------

@pytest.mark.parametrize("flag,value", [("mma_model", True), ("proof", "compiled with CUDA 13.0 instead of 12.8")])
def test_test_and_proof_flavours_are_refused_by_the_shared_check(wheels, tmp_path, flag, value):
    """Marked consistently inside and beside (every other field agrees): the check itself
    refuses them, so the index API (which takes records, not a directory) does too."""
    import zipfile

    w = next(wheels.glob("*+cu130.*.whl"))
    with zipfile.ZipFile(w) as z:
        inner = json.loads(z.read(RECORD_IN_WHEEL))
    inner["extra"][flag] = value
    rewrite_wheel(w, {RECORD_IN_WHEEL: json.dumps(inner).encode()})
    d = json.loads(record_path(w).read_text())
    _edit_record(w, extra={**d["extra"], flag: value})
    _resync(w)
    rec = BuildRecord.load(record_path(w))
    with pytest.raises(RecordError, match=rf"^{re.escape(w.name)}: extra\.{flag}: .*never indexed or published"):
        check_wheel(w, rec)
    out = tmp_path / "idx"
    with pytest.raises(ix.IndexError_, match=rf"extra\.{flag}"):
        ix.write_index([rec], wheels, out)
    assert not out.exists()


def test_a_new_record_for_an_indexed_wheel_is_checked_before_it_replaces_the_entry(wheels, tmp_path):
    out = tmp_path / "idx"
    recs = load_records(wheels)
    ix.write_index(recs, wheels, out)
    before = (out / "index.json").read_bytes()
    rec = next(r for r in recs if r.variant.startswith("cu130"))
    lie = dataclasses.replace(rec, archs=("sm_90a",))  # same file, same sha256, a record that lies about it
    with pytest.raises(ix.IndexError_, match=rf"{re.escape(rec.wheel)}: archs: the beside-record says \["):
        ix.write_index([lie], wheels, out)
    assert (out / "index.json").read_bytes() == before
    honest = dataclasses.replace(rec, index_url="https://mirror.example/sa3/")  # a field only the record has
    with pytest.raises(ix.IndexError_, match="index_url"):
        ix.write_index([honest], wheels, out)  # the wheel's own record says otherwise: refused too
