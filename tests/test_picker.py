"""The index's picker page answers "which wheel?" in the browser: plain JS in index.html reads
the page's own table and turns a pasted torch version into the pip command or the reason
there is none. Its Python twin (``ci.index.pick``, reading index.json) must answer the same:
node runs the page's script on the page's table, Python runs on the manifest, for the same
inputs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ci import index as ix
from ci.stages.record import load_records
from conftest_publish import sage_wheel

NODE = shutil.which("node")

# A stand-in for the few DOM calls the script makes (querySelector/querySelectorAll on the
# table and its rows, getAttribute), built from the page's HTML; then the script's pick() is
# run on every input and the answers printed as JSON.
HARNESS = r"""
const fs = require("fs");
const html = fs.readFileSync(process.argv[2], "utf8");
const inputs = JSON.parse(fs.readFileSync(process.argv[3], "utf8"));
const scripts = [...html.matchAll(/<script>([\s\S]*?)<\/script>/g)].map(m => m[1]);
if (scripts.length !== 1) throw new Error("expected one script, found " + scripts.length);
const unescape = s => s.replace(/&quot;/g, '"').replace(/&#x27;/g, "'").replace(/&lt;/g, "<")
  .replace(/&gt;/g, ">").replace(/&amp;/g, "&");
const attrsOf = tag => {
  const a = {};
  for (const m of tag.matchAll(/([\w-]+)="([^"]*)"/g)) a[m[1]] = unescape(m[2]);
  return {getAttribute: n => (n in a ? a[n] : null), has: n => n in a};
};
const tables = [...html.matchAll(/<table\b([^>]*)>([\s\S]*?)<\/table>/g)];
const fakeDoc = {
  querySelector(sel) {
    if (sel !== "table[data-project]") throw new Error("unexpected selector " + sel);
    const t = tables.find(m => attrsOf(m[1]).has("data-project"));
    const el = attrsOf(t[1]);
    el.querySelectorAll = s => {
      if (s !== "tr[data-page]") throw new Error("unexpected selector " + s);
      return [...t[2].matchAll(/<tr\b([^>]*)>/g)].map(m => attrsOf(m[1])).filter(r => r.has("data-page"));
    };
    return el;
  },
};
const mod = {exports: {}};
new Function("module", "document", scripts[0])(mod, undefined);
const data = mod.exports.readTable(fakeDoc);
console.log(JSON.stringify({rows: data.rows, answers: inputs.map(t => mod.exports.pick(data.rows, data.project, t))}));
"""

INPUTS = [
    "2.14.1+cu130", "2.14.1+cu130 13.0", "  2.14.1+cu130\t13.0 ", "2.14.1,13.0", "2.14.1 13.0", "2.14.1",
    "2.14.1+cu132", "2.14.1+cu132 13.2", "2.14.1 12.8", "2.14.1+cu130 None", "2.13.0+cpu", "2.13.0+cpu None",
    "2.9.0+cu128", "2.9.0+cu130", "2.8.0+cu128", "2.8.0+cu129", "2.8.0+cu126", "2.10.0.dev20250101+cu128",
    "2.10.0a0+git1234", "2.10.0a0+git1234 12.8", "2.11.0+CU128", "2.15.0+cu130", "3.0.0+cu130", "2.9.0+rocm6.2",
    "", "   ", "abc", "2.14", "2", "v2.14.1", "2.14.1+cu130 13.0 extra", "2.14.1+cu130 thirteen", "2.14.1+cu130 13",
    "2.12.0+cu132", "2.12.0+cu126", "02.014.1+cu130", "2.14.1+cu1300",
    "2.15.0+cu132", "2.15.0 12.8", "2.15.0+cu126", "2.15.0+cu118", "2.15.0+cpu",
]


@pytest.fixture(scope="module")
def index_dirs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("picker")
    wd = tmp / "w"
    sage_wheel(wd, "cu130.torch2.10.stable")
    sage_wheel(wd, "cu132.torch2.10.stable", torch_lines=("2.12", "2.13", "2.14"))
    sage_wheel(wd, "cu128.torch2.10.stable", torch_lines=("2.10", "2.11"))
    sage_wheel(wd, "cu128.torch2.8")
    sage_wheel(wd, "cu129.torch2.8")
    out = {}
    for name, base in (("absolute", "https://octo.github.io/sageattn3/"), ("relative", None)):
        out[name] = tmp / name
        ix.write_index(load_records(wd), wd, out[name], base_url=base)
    return out


def _python_answers(index_dir: Path) -> tuple[list[dict], list[dict]]:
    manifest = json.loads((index_dir / "index.json").read_text())
    rows = ix.picker_rows(manifest)
    return rows, [ix.pick(rows, manifest["project"], t) for t in INPUTS]


@pytest.mark.skipif(NODE is None, reason="node is not installed")
@pytest.mark.parametrize("which", ["absolute", "relative"])
def test_the_page_script_and_python_give_the_same_answers(index_dirs, tmp_path, which):
    index_dir = index_dirs[which]
    harness, inputs = tmp_path / "harness.cjs", tmp_path / "inputs.json"
    harness.write_text(HARNESS)
    inputs.write_text(json.dumps(INPUTS))
    p = subprocess.run([NODE, str(harness), str(index_dir / "index.html"), str(inputs)], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    js = json.loads(p.stdout)
    rows, answers = _python_answers(index_dir)
    assert js["rows"] == rows  # the page's table is the manifest's pages
    for text, a, b in zip(INPUTS, js["answers"], answers):
        assert a == b, text
    kinds = {a["kind"] for a in answers}
    assert kinds == {"ok", "cpu", "rocm", "no-cuda", "unknown-line", "no-variant", "unparsed", "empty"}


def test_answers(index_dirs):
    rows, answers = _python_answers(index_dirs["absolute"])
    got = dict(zip(INPUTS, answers))
    base = "https://octo.github.io/sageattn3/"
    assert got["2.14.1+cu130"]["command"] == f"pip install --no-deps sageattn3 --index-url {base}cu130/torch2.14/"
    assert got["2.14.1 13.0"]["page"] == got["2.14.1,13.0"]["page"] == "cu130/torch2.14"
    assert got["2.14.1+cu132"]["page"] == "cu132/torch2.14"          # compiled with the same CUDA preferred
    assert got["2.12.0+cu132"]["page"] == "cu132/torch2.12"
    assert got["2.8.0+cu129"]["page"] == "cu129/torch2.8"
    assert got["2.8.0+cu126"]["page"] == "cu128/torch2.8"            # no 12.6 build: the newest 12.x one
    assert got["2.10.0.dev20250101+cu128"]["page"] == "cu128/torch2.10"
    assert got["2.10.0a0+git1234 12.8"]["page"] == "cu128/torch2.10"
    assert got["2.11.0+CU128"]["page"] == "cu128/torch2.11"
    assert got["2.14.1+cu130"]["links"] == f"{base}links/cu130-torch2.14.html"
    assert got["2.13.0+cpu"]["kind"] == got["2.14.1+cu130 None"]["kind"] == "cpu"
    assert "CPU-only build" in got["2.13.0+cpu"]["reason"]
    assert got["2.14.1"]["kind"] == "no-cuda" and "torch.version.cuda" in got["2.14.1"]["reason"]
    # newer than every line here (PyPI serves torch 2.15): the newest stable-ABI page of its CUDA major
    assert got["2.15.0+cu130"]["page"] == got["3.0.0+cu130"]["page"] == "cu130/torch2.14"
    assert got["2.15.0+cu130"]["reason"] == ("torch 2.15 built for CUDA 13.0: wheels compiled with CUDA 13.0; torch 2.15 "
                                             "is newer than every torch line built here: stable-ABI wheels built against "
                                             "torch 2.14, not tested with torch 2.15")
    assert got["2.15.0+cu132"]["page"] == "cu132/torch2.14"
    assert got["2.15.0 12.8"]["page"] == got["2.15.0+cu126"]["page"] == "cu128/torch2.11"  # 12.x: its newest stable line
    assert got["2.15.0+cu118"]["kind"] == "no-variant"
    assert got["2.15.0+cu118"]["reason"].endswith("the stable-ABI wheels that load into it are served for CUDA 12.8, 13.0, 13.2")
    assert got["2.15.0+cpu"]["kind"] == "cpu"
    assert [r["stable"] for r in rows if r["line"] == "2.8"] == ["false", "false"]  # per-torch wheels: never offered beyond
    assert got["2.9.0+cu128"]["kind"] == "unknown-line"              # no wheel serves torch 2.9 here
    assert got["2.9.0+cu128"]["reason"].endswith("it serves torch 2.8, 2.10, 2.11, 2.12, 2.13, 2.14")
    assert got["2.12.0+cu126"]["kind"] == "no-variant" and "served for CUDA 13.0, 13.2" in got["2.12.0+cu126"]["reason"]
    assert got["2.9.0+rocm6.2"]["kind"] == "rocm"
    for bad in ("abc", "2", "v2.14.1", "2.14.1+cu130 13.0 extra", "2.14.1+cu130 thirteen", "2.14.1+cu130 13"):
        assert got[bad]["kind"] == "unparsed", bad
    page = (index_dirs["absolute"] / "index.html").read_text()
    assert 'id="torch-version"' in page and 'id="pick-answer"' in page and "<script src" not in page


def _user_side_which():
    """sageattn3's own `python -m sageattn3 which` logic (standard library only), loaded from
    the payload's source without importing the package (which needs torch)."""
    import importlib.util

    from conftest_publish import REPO

    spec = importlib.util.spec_from_file_location("sageattn3_which", REPO / "sageattn3" / "sageattn3" / "_which.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_the_user_side_command_agrees_with_the_picker(index_dirs):
    """`python -m sageattn3 which` reads the pages from the installed wheel's build record
    (extra.index_pages): given this index's pages, it must name the same page and command."""
    which = _user_side_which()
    manifest = json.loads((index_dirs["absolute"] / "index.json").read_text())
    rows = ix.picker_rows(manifest)
    record = {"index_url": manifest["base_url"],
              "extra": {"index_pages": [r["page"] for r in rows], "stable_abi_floor": "2.10"}}
    compared = 0
    for text in INPUTS:
        mine = ix.pick(rows, "sageattn3", text)
        tokens = text.replace(",", " ").split()
        if mine["kind"] in ("unparsed", "empty", "no-cuda"):
            continue  # input the command line takes differently (--torch/--cuda options)
        spec = which.torch_spec(tokens[0], tokens[1] if len(tokens) == 2 and tokens[1] != "None" else None)
        if len(tokens) == 2 and tokens[1] == "None":
            continue  # the command line has no "None" CUDA: it asks the running torch
        theirs = which.answer(spec, record, reinstall=False)
        assert theirs.page == mine.get("page"), (text, theirs, mine)
        assert theirs.command == mine.get("command"), (text, theirs, mine)
        compared += 1
    assert compared >= 20


def test_the_pages_the_factory_promises_are_the_pages_the_index_writes(tmp_path):
    """ci.stages.build.index_pages(matrix) goes into every wheel's build record (what the guard and
    `python -m sageattn3 which` may name); the index, given one wheel per target of the same
    matrix, must write exactly those pages, flagged stable-ABI exactly from the floor on."""
    from ci.stages.build import index_pages
    from ci.toolchain.targets import Matrix

    which = _user_side_which()
    matrix = Matrix.load()
    wd = tmp_path / "w"
    platforms = {"linux-x86_64": "manylinux_2_28_x86_64", "linux-aarch64": "manylinux_2_28_aarch64",
                 "windows-amd64": "win_amd64"}
    for t in matrix.targets:
        sage_wheel(wd, t.variant.label, "1.0.0", torch_lines=t.torch_lines, platform=platforms[t.os.key], os_key=t.os.key)
    out = tmp_path / "idx"
    ix.write_index(load_records(wd), wd, out)
    manifest = json.loads((out / "index.json").read_text())
    rows = ix.picker_rows(manifest)
    assert sorted(r["page"] for r in rows) == index_pages(matrix)
    floor = which.stable_floor({"extra": {"stable_abi_floor": matrix.stable_abi_floor}})
    for r in rows:
        line = tuple(int(x) for x in r["line"].split("."))
        assert r["stable"] == ("true" if line >= floor else "false"), r
    assert (out / r["page"] / "sageattn3" / "index.html").is_file()


BROWSER_HARNESS = r"""
const fs = require("fs");
const html = fs.readFileSync(process.argv[2], "utf8");
const base = process.argv[3];
const scripts = [...html.matchAll(/<script>([\s\S]*?)<\/script>/g)].map(m => m[1]);
const mod = {exports: {}};
new Function("module", "document", scripts[0])(mod, undefined);
const table = html.match(/<table\b[^>]*data-project[^>]*>([\s\S]*?)<\/table>/)[1];
const rows = [...table.matchAll(/<tr\b[^>]*data-page[^>]*>([\s\S]*?)<\/tr>/g)].map(m => m[1]);
const anchors = rows.flatMap(r => [...r.matchAll(/<a href="([^"]*)">([^<]*)<\/a>/g)])
  .map(m => ({href: m[1], textContent: m[2], getAttribute(n) { return n === "href" ? this.href : null; }}));
mod.exports.absolutize(anchors, base);
const hashes = ["", "#", "#2.14.1%2Bcu130%2013.0", "#2.14.1+cu130", "#%E0%A4%A", "#100%", "#%"];
console.log(JSON.stringify({texts: anchors.map(a => a.textContent),
                            fragments: hashes.map(h => mod.exports.fragmentText(h))}));
"""


@pytest.mark.skipif(NODE is None, reason="node is not installed")
def test_the_table_commands_are_absolute_and_a_malformed_fragment_gets_a_message(index_dirs, tmp_path):
    """A page written without a base URL (a local index, or one served under another address)
    shows, in the browser, the same absolute commands as one written with it; the URL fragment
    that pre-fills the box is decoded, and a malformed one gets a message, not an exception."""
    import html as htmllib
    import re

    base = "https://octo.github.io/sageattn3/"
    harness = tmp_path / "browser.cjs"
    harness.write_text(BROWSER_HARNESS)
    p = subprocess.run([NODE, str(harness), str(index_dirs["relative"] / "index.html"), base], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout)
    absolute_page = (index_dirs["absolute"] / "index.html").read_text()
    table = re.search(r"<table\b[^>]*data-project[^>]*>(.*?)</table>", absolute_page, re.S).group(1)
    want = [htmllib.unescape(t) for t in re.findall(r'<a href="[^"]*">([^<]*)</a>', table)]
    assert got["texts"] == want and all(t.startswith(base) for t in want)
    relative_texts = re.findall(r'<a href="[^"]*">([^<]*)</a>', (index_dirs["relative"] / "index.html").read_text())
    assert not relative_texts[0].startswith("http")  # what the page says before its script runs
    frags = got["fragments"]
    assert [f["text"] for f in frags[:4]] == ["", "", "2.14.1+cu130 13.0", "2.14.1+cu130"]
    assert all("error" not in f for f in frags[:4])
    for f in frags[4:]:
        assert f["text"] == "" and "is not valid percent-encoding" in f["error"] and "paste what" in f["error"]
