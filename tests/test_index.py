"""The pip index: layout, attributes, escaping, determinism, merging, the crawler, and real
pip in fresh virtual environments resolving the right variant without touching torch."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from ci import index as ix
from ci.stages.record import load_records
from conftest_publish import REPO, Venv, sage_wheel, serve_dir, torch_standin

VARIANTS = ("cu130.torch2.10.stable", "cu128.torch2.10.stable", "cu128.torch2.8")


def _wheels(d: Path, version: str = "1.0.0", variants=VARIANTS) -> Path:
    for v in variants:
        lines = ("2.10", "2.11") if v == "cu128.torch2.10.stable" else None
        sage_wheel(d, v, version, torch_lines=lines)
    return d


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_layout_pages_and_anchor_attributes(tmp_path):
    wd = _wheels(tmp_path / "w")
    out = tmp_path / "idx"
    pages = ix.write_index(load_records(wd), wd, out)  # the pipeline's call signature
    paths = {p.path for p in pages}
    assert {"simple", "cu130", "cu128", "cu130/torch2.14", "cu130/torch2.10", "cu128/torch2.8",
            "cu128/torch2.11"} <= paths
    assert "cu128/torch2.12" not in paths  # the cu128 stable wheel was published for 2.10-2.11 only
    for p in pages:
        assert (out / p.path / "index.html").exists()
        assert (out / p.path / "sageattn3" / "index.html").exists()
        assert (out / "links" / f"{p.flat_name}.html").exists()
    page = (out / "cu130/torch2.14/sageattn3/index.html").read_bytes()
    anchors = ix.parse_anchors(page)
    assert len(anchors) == 1
    a = anchors[0]
    wheel = next(wd.glob("*cu130.torch2.10.stable*.whl"))
    assert a["href"].startswith("../../../files/sageattn3-1.0.0%2Bcu130.torch2.10.stable-cp310-abi3-")
    assert a["href"].endswith("#sha256=" + hashlib.sha256(wheel.read_bytes()).hexdigest())
    assert a["data-requires-python"] == ">=3.10"
    assert b'data-requires-python="&gt;=3.10"' in page  # escaped in the bytes
    meta = (out / "files" / (wheel.name + ".metadata")).read_bytes()
    assert a["data-core-metadata"] == a["data-dist-info-metadata"] == "sha256=" + hashlib.sha256(meta).hexdigest()
    assert b"Requires-Dist: torch>=2.10" in meta
    # the all-variants page lists everything; the root table names every per-torch page
    assert len(ix.parse_anchors((out / "simple/sageattn3/index.html").read_bytes())) == 3
    root = (out / "index.html").read_text()
    for p in paths:
        if "/torch" in p:
            assert f'href="{p}/"' in root
    man = json.loads((out / "index.json").read_text())
    assert sorted(man["wheels"]) == sorted(w.name for w in wd.glob("*.whl"))


def test_html_escaping_of_names_and_attributes(tmp_path):
    wd = tmp_path / "w"
    _, rec = sage_wheel(wd, "cu130.torch2.10.stable", requires_python='>=3.10,!=3.12.*,<"4"&')
    out = tmp_path / "idx"
    ix.write_index([rec], wd, out)
    page = (out / "simple/sageattn3/index.html").read_bytes()
    assert b'&lt;&quot;4&quot;&amp;' in page and b'<"4"' not in page
    assert ix.parse_anchors(page)[0]["data-requires-python"] == '>=3.10,!=3.12.*,<"4"&'


def test_output_is_deterministic(tmp_path):
    wd = _wheels(tmp_path / "w")
    recs = load_records(wd)
    a, b = tmp_path / "a", tmp_path / "b"
    ix.write_index(recs, wd, a, base_url="https://example.org/idx")
    ix.write_index(list(reversed(recs)), wd, b, base_url="https://example.org/idx")
    assert _tree(a) == _tree(b)
    before = {p: (a / p).stat().st_mtime_ns for p in _tree(a)}
    r = ix.update_index(recs, wd, a)  # re-run: nothing rewritten (base URL remembered)
    assert r.written == [] and r.added == [] and r.deleted == []
    assert {p: (a / p).stat().st_mtime_ns for p in _tree(a)} == before
    assert "https://example.org/idx/cu130/torch2.14/" in (a / "index.html").read_text()


def test_incremental_merge_keeps_earlier_versions_and_removes_on_request(tmp_path):
    out = tmp_path / "idx"
    w1 = _wheels(tmp_path / "w1", "1.0.0")
    ix.write_index(load_records(w1), w1, out)
    w2 = _wheels(tmp_path / "w2", "1.1.0", variants=("cu130.torch2.10.stable",))
    r = ix.update_index(load_records(w2), w2, out)
    assert len(r.added) == 1
    names = [a["href"] for a in ix.parse_anchors((out / "cu130/torch2.14/sageattn3/index.html").read_bytes())]
    assert len(names) == 2 and any("1.0.0" in n for n in names) and any("1.1.0" in n for n in names)
    assert (out / "cu128/torch2.8/sageattn3/index.html").exists()  # untouched by the second release
    # removal of a version drops its wheels, metadata files and the pages only it had
    r = ix.update_index([], w2, out, remove=["1.0.0"])
    assert len(r.removed) == 3
    assert not (out / "cu128").exists() and not (out / "links/cu128-torch2.8.html").exists()
    assert not list((out / "files").glob("sageattn3-1.0.0*"))
    names = [a["href"] for a in ix.parse_anchors((out / "cu130/torch2.14/sageattn3/index.html").read_bytes())]
    assert len(names) == 1 and "1.1.0" in names[0]
    # the merged result is the same as building 1.1.0 alone
    alone = tmp_path / "alone"
    ix.write_index(load_records(w2), w2, alone)
    assert _tree(alone) == _tree(out)
    with pytest.raises(ix.IndexError_, match="no indexed wheel"):
        ix.update_index([], w2, out, remove=["9.9.9"])


def test_refuses_a_changed_wheel_under_the_same_name(tmp_path):
    out = tmp_path / "idx"
    w1 = tmp_path / "w1"
    sage_wheel(w1, "cu130.torch2.10.stable")
    ix.write_index(load_records(w1), w1, out)
    w2 = tmp_path / "w2"
    sage_wheel(w2, "cu130.torch2.10.stable", payload=b"rebuilt")
    before = _tree(out)
    with pytest.raises(ix.IndexError_, match="never\\s+replaced in place"):
        ix.write_index(load_records(w2), w2, out)
    assert _tree(out) == before


def test_yank_marks_the_anchor(tmp_path):
    wd = _wheels(tmp_path / "w", variants=("cu130.torch2.10.stable",))
    out = tmp_path / "idx"
    name = next(wd.glob("*.whl")).name
    ix.write_index(load_records(wd), wd, out, yank={name: "broken <kernel>"})
    a = ix.parse_anchors((out / "simple/sageattn3/index.html").read_bytes())[0]
    assert a["data-yanked"] == "broken <kernel>"


@pytest.mark.parametrize("pasted,page", [
    ("2.14.1+cu130", "cu130/torch2.14"),
    ("2.14.1 13.0", "cu130/torch2.14"),            # PyPI's unlabelled build: torch.version.cuda tells
    ("2.12.0+cu132", "cu130/torch2.12"),           # no cu132 wheel: the 13.0 build serves 13.x
    ("2.11.0+cu128", "cu128/torch2.11"),
    ("2.8.0+cu128", "cu128/torch2.8"),
    ("2.8.0+cu129 12.9", "cu128/torch2.8"),
    ("2.12.0+cu126", None),                        # CUDA 12 wheels only serve 2.8, 2.10, 2.11
    ("2.14.1+cpu", None),
    ("2.14.1 None", None),
    ("2.15.0+cu130", "cu130/torch2.14"),           # newer than every line: the newest stable-ABI page
    ("2.9.0+cu130", None),                         # a torch line the index does not serve
    ("2.14.1", None),                              # unlabelled without torch.version.cuda: cannot tell
])
def test_pick_page(tmp_path, pasted, page):
    wd = _wheels(tmp_path / "w")
    out = tmp_path / "idx"
    ix.write_index(load_records(wd), wd, out)
    manifest = json.loads((out / "index.json").read_text())
    got = ix.pick(ix.picker_rows(manifest), "sageattn3", pasted)
    assert got.get("page") == page, got
    if page is None:
        assert got["kind"] != "ok" and got["reason"]
    else:
        assert got["command"] == f"pip install --no-deps sageattn3 --index-url {page}/"


def test_crawler_checks_every_link_over_http(tmp_path):
    wd = _wheels(tmp_path / "w")
    out = tmp_path / "idx"
    ix.write_index(load_records(wd), wd, out)
    with serve_dir(out) as url:
        assert ix.check_index(url, log=lambda *a: None) == 3
        # an independent crawl: every anchor of every page, over HTTP
        man = json.loads(urllib.request.urlopen(url + "index.json", timeout=10).read())
        for path in man["pages"]:
            page_url = f"{url}{path}/sageattn3/"
            for a in ix.parse_anchors(urllib.request.urlopen(page_url, timeout=10).read()):
                file_url, _, frag = urllib.parse.urljoin(page_url, a["href"]).partition("#")
                data = urllib.request.urlopen(file_url, timeout=10).read()
                assert frag == "sha256=" + hashlib.sha256(data).hexdigest()
                meta = urllib.request.urlopen(file_url + ".metadata", timeout=10).read()
                assert a["data-core-metadata"] == "sha256=" + hashlib.sha256(meta).hexdigest()
        # a corrupted file is caught
        victim = next((out / "files").glob("*.whl"))
        victim.write_bytes(victim.read_bytes() + b"x")
        with pytest.raises(ix.IndexError_, match="sha256"):
            ix.check_index(url, log=lambda *a: None)


import urllib.parse  # noqa: E402


@pytest.fixture(scope="module")
def served_index(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("served")
    wd = _wheels(tmp / "w")
    _wheels(wd, "0.9.0", variants=("cu130.torch2.10.stable",))  # an older release on the same page
    out = tmp / "idx"
    ix.write_index(load_records(wd), wd, out)
    torches = tmp / "torch"
    for v in ("2.14.1+cu130", "2.8.0+cu128"):
        torch_standin(torches, v)
    with serve_dir(out) as url:
        yield url, torches


def _venv_with_torch(tmp_path, torches: Path, version: str) -> Venv:
    venv = Venv(tmp_path / "venv")
    wheel = next(torches.glob(f"torch-{version}-*.whl"))
    venv.pip("install", "--no-index", str(wheel))
    assert venv.installed()["torch"] == version
    return venv


@pytest.mark.parametrize("torch,page,variant", [
    ("2.14.1+cu130", "cu130/torch2.14/", "cu130.torch2.10.stable"),
    ("2.8.0+cu128", "cu128/torch2.8/", "cu128.torch2.8"),
])
def test_pip_installs_the_matching_variant_and_leaves_torch(tmp_path, served_index, torch, page, variant):
    url, torches = served_index
    venv = _venv_with_torch(tmp_path, torches, torch)
    before = len(url.requested)
    venv.pip("install", "sageattn3", "--index-url", url + page)
    got = venv.installed()
    assert got["torch"] == torch
    assert got["sageattn3"] == f"1.0.0+{variant}"  # the newest version on the page
    assert venv.run("import sageattn3; print(sageattn3.VARIANT)") == variant
    assert any(p.endswith(".whl.metadata") for p in url.requested[before:])  # pip used PEP 658


def test_pip_find_links_form(tmp_path, served_index):
    url, torches = served_index
    venv = _venv_with_torch(tmp_path, torches, "2.14.1+cu130")
    venv.pip("install", "sageattn3", "--no-index", "--find-links", url + "links/cu130-torch2.14.html")
    assert venv.installed()["sageattn3"] == "1.0.0+cu130.torch2.10.stable"
    assert venv.installed()["torch"] == "2.14.1+cu130"


def test_pip_refuses_a_mismatched_page_without_touching_torch(tmp_path, served_index):
    url, torches = served_index
    venv = _venv_with_torch(tmp_path, torches, "2.8.0+cu128")
    p = venv.pip("install", "sageattn3", "--index-url", url + "cu130/torch2.14/", check=False)
    assert p.returncode != 0
    assert "torch" in (p.stdout + p.stderr)  # pip names the conflicting requirement
    assert venv.installed()["torch"] == "2.8.0+cu128" and "sageattn3" not in venv.installed()
    # and the picker names the right page (served: the absolute URL of it)
    manifest = json.loads(urllib.request.urlopen(url + "index.json", timeout=10).read())
    got = ix.pick(ix.picker_rows(manifest, url), "sageattn3", "2.8.0+cu128")
    assert got["command"] == f"pip install --no-deps sageattn3 --index-url {url}cu128/torch2.8/"


def test_cli_build_check_and_which_points_at_the_user_side_command(tmp_path):
    wd = _wheels(tmp_path / "w")
    out = tmp_path / "idx"
    run = lambda *a: subprocess.run([sys.executable, "-m", "ci.index", *a], cwd=REPO, capture_output=True,  # noqa: E731
                                    text=True, timeout=60)
    p = run("--wheels", str(wd), "--out", str(out), "--base-url", "https://o.github.io/r")
    assert p.returncode == 0, p.stderr
    assert run("check", str(out)).returncode == 0
    p = run("which", "--index", str(out), "--torch", "2.13.0+cu130")
    assert p.returncode == 2 and "python -m sageattn3 which" in p.stderr and "Traceback" not in p.stderr
    p = run("--wheels", str(tmp_path / "typo"), "--out", str(tmp_path / "idx2"))
    assert p.returncode == 2 and "no such directory" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "idx2").exists()


def _drop(field: str):
    return lambda m: {**m, "wheels": {k: {x: y for x, y in v.items() if x != field} for k, v in m["wheels"].items()}}


@pytest.mark.parametrize("damage,needle", [
    (lambda m: "{damaged", "index.json: not a readable index manifest"),
    (lambda m: b"\xff\xfe", "index.json: not a readable index manifest"),
    (lambda m: [m], "index.json: an index manifest is a JSON object, this is list"),
    (lambda m: {**m, "wheels": []}, "index.json: field wheels: list, expected an object"),
    (_drop("target"), ".whl: field target: missing from the build record"),
    (_drop("metadata_sha256"), ".whl: field metadata_sha256: null, expected a sha256"),
    (lambda m: {**m, "wheels": {k: {**v, "archs": "sm_120a"} for k, v in m["wheels"].items()}}, ": field archs: str, expected list"),
    (lambda m: {**m, "wheels": {k + "x": v for k, v in m["wheels"].items()}}, ".whlx: field wheel:"),
    (lambda m: {**m, "wheels": {k: 7 for k in m["wheels"]}}, ".whl: a build record is a JSON object, this is int"),
], ids=["not-json", "not-utf8", "not-an-object", "wheels-not-an-object", "entry-without-target",
        "entry-without-metadata-sha256", "entry-archs-not-a-list", "entry-under-another-name", "entry-not-an-object"])
def test_a_damaged_manifest_is_refused_in_one_line_naming_the_file_and_field(tmp_path, capsys, damage, needle):
    wd = _wheels(tmp_path / "w", variants=VARIANTS[:1])
    out = tmp_path / "idx"
    assert ix.main(["build", "--wheels", str(wd), "--out", str(out)]) == 0
    capsys.readouterr()
    manifest = json.loads((out / "index.json").read_text())
    damaged = damage(manifest)
    data = damaged if isinstance(damaged, bytes) else (damaged if isinstance(damaged, str) else json.dumps(damaged)).encode()
    (out / "index.json").write_bytes(data)
    for args in (["--wheels", str(wd)], ["--remove", "9.9.9"]):  # merging, and removing only
        rc = ix.main(["build", *args, "--out", str(out)])
        err = capsys.readouterr().err
        assert rc == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert str(out / "index.json") in err and needle in err, err
        assert (out / "index.json").read_bytes() == data  # nothing written
