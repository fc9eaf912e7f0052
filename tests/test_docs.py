"""The README and docs/: the README stays a front page, every command they show names a real nox
session, module, subcommand and option, every link between them resolves, the generated tables
are current, and the pages are served as HTML beside the index."""

from __future__ import annotations

import ast
import functools
import os
import re
import shlex
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from ci.release import docs_site
from ci.release.docs_site import __main__ as docs_cli
from ci import index as ix
from ci.stages.record import load_records
from conftest_publish import sage_wheel, serve_dir

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
PAGES = [README, REPO / "RELEASING.md", *sorted((REPO / "docs").glob("*.md"))]
sys.path.insert(0, str(REPO / "tests" / "bench"))


# -- the front page -------------------------------------------------------------------------

def test_readme_is_a_front_page_in_the_issue_order():
    text = README.read_text()
    assert len(text.splitlines()) <= 150
    assert re.findall(r"^## (.+)$", text, re.M) == [
        "Installing", "Checking the install", "Accuracy", "Supported matrix", "Set-up for contributors", "Links"]
    assert "Not yet run on Blackwell hardware" in text.split("\n## ", 1)[0]
    for page in sorted((REPO / "docs").glob("*.md")):  # every page is reachable from the README
        assert f"](docs/{page.name})" in text, f"the README's links do not name docs/{page.name}"


def _fences(text: str, lang: str) -> list[str]:
    return [t.content for t in docs_site._markdown().parse(text) if t.type == "fence" and t.info.strip() == lang]


def test_the_first_screen_shows_the_install_and_the_call_that_replaces_sdpa():
    """Before the first section: the Installing section's --index-url command, then four lines
    where sageattn3_blackwell takes SDPA's place with SDPA's arguments; run here on the CPU (where
    the call is torch's SDPA), the example gives SDPA's output."""
    text = README.read_text()
    first = text.split("\n## ", 1)[0]
    installing = text.split("\n## Installing\n", 1)[1].split("\n## ", 1)[0]
    (install,) = _fences(first, "bash")
    assert install.strip() in [ln for ln in installing.splitlines() if "--index-url" in ln]
    (example,) = _fences(first, "python")
    assert len(example.splitlines()) == 4
    sdpa = re.search(r"^# out = torch\.nn\.functional\.scaled_dot_product_attention\((.+)\)$", example, re.M)
    ours = re.search(r"^out = sageattn3\.sageattn3_blackwell\((.+)\)$", example, re.M)
    assert sdpa and ours and sdpa[1] == ours[1], example
    assert 'device="cuda"' in example
    script = example.replace('device="cuda"', 'device="cpu"') + (
        "ref = torch.nn.functional.scaled_dot_product_attention(" + sdpa[1] + ")\n"
        "assert out.shape == q.shape and out.dtype == q.dtype and torch.equal(out, ref)\nprint('same as SDPA')\n")
    env = {**os.environ, "PYTHONPATH": str(REPO / "sageattn3")}
    run = subprocess.run([sys.executable, "-W", "ignore", "-c", script], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "same as SDPA", run.stderr[-2000:]


# -- commands ------------------------------------------------------------------------------

def _code(path: Path) -> list[str]:
    """Shell lines of a page: each line of its bash blocks and each inline code span."""
    out = []
    for t in docs_site._markdown().parse(path.read_text()):
        if t.type == "fence" and t.info.strip() in ("bash", "sh", "console"):
            out += [ln.split(" #", 1)[0] for ln in t.content.splitlines()]
        for c in t.children or []:
            if c.type == "code_inline":
                out.append(c.content)
    return out


def commands(path: Path) -> list[list[str]]:
    """The factory's and the payload's commands a page shows: nox sessions, ``python -m`` and
    ``python tests/...`` scripts, as argument lists (a nox command keeps ``-s NAME``)."""
    found = []
    for line in _code(path):
        for seg in re.split(r"\s*(?:&&|;)\s*", line.strip()):
            seg = re.sub(r"^(pipx run |uvx )", "", seg)
            seg = re.sub(r"^\.nox/[\w-]+/bin/python ", "python ", seg)
            if not re.match(r"(nox -s |python3? -m |python tests/)", seg):
                continue
            try:
                argv = shlex.split(seg.replace("[", " ").replace("]", " "))
            except ValueError:
                continue
            found.append([a for a in argv if a != "..."])
    return found


def _nox_sessions() -> dict[str, list[str]]:
    """noxfile session name -> the ``python -m MODULE [fixed args]`` it runs (empty: none)."""
    out = {}
    for fn in ast.parse((REPO / "noxfile.py").read_text()).body:
        if not isinstance(fn, ast.FunctionDef):
            continue
        deco = next((d for d in fn.decorator_list if "session" in ast.unparse(d)), None)
        if deco is None:
            continue
        name = next((k.value.value for k in getattr(deco, "keywords", []) if k.arg == "name"), fn.name)
        runs = []
        for node in ast.walk(fn):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "session.run":
                consts = [a.value if isinstance(a, ast.Constant) else None for a in node.args]
                if "-m" in consts:
                    rest = consts[consts.index("-m") + 1:]
                    runs = [c for c in rest[:next((i for i, c in enumerate(rest) if c is None), len(rest))]]
                    break
        out[name] = runs
    return out


def _module_file(module: str) -> Path:
    parts = module.split(".")
    root = REPO / "sageattn3" if parts[0] == "sageattn3" else REPO
    base = root.joinpath(*parts)
    for p in (base / "__main__.py", base.with_suffix(".py")):
        if p.is_file():
            return p
    raise AssertionError(f"python -m {module}: no such module in the repository")


@functools.cache
def _cli_words(module_or_script: str) -> tuple[set[str], set[str]]:
    """(options, subcommands) a module's or script's command line accepts, read from its source:
    ``add_argument`` / ``add_parser`` names, and the literals its ``main`` compares argv with
    (aliases such as ``--dry-run``). The modules of the same package it imports count too."""
    path = REPO / module_or_script if module_or_script.endswith(".py") else _module_file(module_or_script)
    files, opts, subs = [path], set(), set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("ci", "sageattn3"):
            try:
                files.append(_module_file(node.module))
            except AssertionError:
                pass
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
                first = node.args[0]
                if isinstance(first, ast.Constant) and isinstance(first.value, str):
                    if node.func.attr == "add_argument":
                        opts |= {a.value for a in node.args if isinstance(a, ast.Constant)}
                    elif node.func.attr == "add_parser":
                        subs.add(first.value)
            if isinstance(node, ast.Compare):
                for c in ast.walk(node):
                    if isinstance(c, ast.Constant) and isinstance(c.value, str):
                        (opts if c.value.startswith("-") else subs).add(c.value)
    return opts, subs


def _check(argv: list[str], cli: str, where: str) -> None:
    opts, subs = _cli_words(cli)
    user = [a for a in argv if not re.fullmatch(r"[A-Z][A-Z0-9_./=-]*|X\.Y|vX\.Y\.Z|OWNER/NAME", a)]
    for i, a in enumerate(user):
        if a.startswith("--"):
            assert a.split("=", 1)[0] in opts, f"{where}: {cli} has no option {a} (it has {sorted(opts)})"
        elif i == 0 and subs and not a.startswith("-"):
            assert set(a.split("|")) <= subs, f"{where}: {cli} has no subcommand {a} (it has {sorted(subs)})"


def _all_commands() -> list[tuple[str, list[str]]]:
    return [(p.relative_to(REPO).as_posix(), c) for p in PAGES for c in commands(p)]


EXTERNAL = {"pip", "venv", "pytest", "cibuildwheel"}  # other projects' modules: not this repository's CLI


def test_every_command_names_a_real_session_module_and_option():
    sessions = _nox_sessions()
    cmds = _all_commands()
    assert len(cmds) > 60  # the extraction finds the pages' commands
    for where, argv in cmds:
        if argv[0] == "nox":
            assert argv[1] == "-s" and argv[2] in sessions, f"{where}: no nox session {argv[2]!r}: {argv}"
            module = sessions[argv[2]]
            if "--" in argv and module:
                _check(module[1:] + argv[argv.index("--") + 1:], module[0], where)
        elif argv[1] == "-m":
            if argv[2] in EXTERNAL:
                continue
            _check(argv[3:], argv[2], where)
        else:  # python tests/...py
            assert (REPO / argv[1]).is_file(), f"{where}: {argv[1]} does not exist"
            _check(argv[2:], argv[1], where)


def test_the_command_check_catches_a_wrong_session_option_and_subcommand(tmp_path):
    sessions = _nox_sessions()
    assert sessions["build-wheels"] == ["ci", "build-wheels"] and sessions["release"] == ["ci.release"]
    _check(["--dry-run"], "ci.release", "ok")  # main's alias of the dry-run subcommand
    with pytest.raises(AssertionError, match="has no option --all-targets"):
        _check(["build-wheels", "--all-targets"], "ci", "x")
    with pytest.raises(AssertionError, match="has no subcommand publish"):
        _check(["publish"], "ci.release", "x")
    page = tmp_path / "p.md"
    page.write_text("Run `nox -s build-wheels -- --target ID`, then:\n\n```bash\npipx run nox -s tests  # all\n"
                    "python3 -m pip install nox && nox -s clean -- --dist\n```\n")
    assert commands(page) == [["nox", "-s", "build-wheels", "--", "--target", "ID"], ["nox", "-s", "tests"],
                              ["python3", "-m", "pip", "install", "nox"], ["nox", "-s", "clean", "--", "--dist"]]


# -- links and the site --------------------------------------------------------------------

def test_every_link_between_the_pages_resolves():
    site = docs_site.render_site(REPO)  # raises DocsError on a broken link or fragment
    assert set(site) == {"docs/index.html", "docs/releasing.html"} | {
        f"docs/{p.stem}.html" for p in (REPO / "docs").glob("*.md")}
    readme = site["docs/index.html"].decode()
    assert 'href="install.html"' in readme and 'href="factory.html#exit-status"' in readme
    assert 'id="checking-the-install-python--m-sageattn3"' in site["docs/install.html"].decode()


def test_a_broken_link_or_fragment_is_named(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("# T\n\n[a](docs/a.md#nope)\n")
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## Some heading\n\n[back](../README.md)\n")
    with pytest.raises(docs_site.DocsError, match=r"README.md: link 'docs/a.md#nope': docs/a.md has no heading"):
        docs_site.render_site(tmp_path)
    (tmp_path / "README.md").write_text("# T\n\n[a](docs/a.md#some-heading) [b](ci/gone.py)\n")
    with pytest.raises(docs_site.DocsError, match=r"ci/gone.py does not exist"):
        docs_site.render_site(tmp_path)
    (tmp_path / "ci").mkdir()
    (tmp_path / "ci" / "gone.py").write_text("")
    site = docs_site.render_site(tmp_path, repo="octo/sageattn3")
    assert 'href="https://github.com/octo/sageattn3/blob/HEAD/ci/gone.py"' in site["docs/index.html"].decode()
    assert "gone.py" not in re.sub(r"<nav>.*?</nav>", "", docs_site.render_site(tmp_path)["docs/index.html"].decode())


def test_the_site_serves_the_docs_beside_the_index(tmp_path):
    """The index and the pages, written as the Pages branch holds them, over a real HTTP server."""
    wd = tmp_path / "wheels"
    sage_wheel(wd, "cu130.torch2.10.stable", "1.0.0")
    out = tmp_path / "site"
    ix.write_index(load_records(wd), wd, out)
    assert docs_cli.main(["--out", str(out), "--repo", "octo/sageattn3"]) == 0
    with serve_dir(out) as url:
        page = urllib.request.urlopen(f"{url}docs/accuracy.html", timeout=30).read().decode()
        assert "<table>" in page and "zero-mean Q, K, V" in page and 'href="../"' in page
        front = urllib.request.urlopen(f"{url}docs/", timeout=30).read().decode()
        assert 'href="accuracy.html"' in front and "pip install --no-deps sageattn3" in front
        assert ix.check_index(url, log=lambda *a: None) == 1  # the index beside them is intact


# -- generated tables ----------------------------------------------------------------------

def _block(text: str, name: str) -> str:
    return re.search(rf"<!-- {name}:start -->\n(.*?)\n<!-- {name}:end -->", text, re.S).group(1)


def test_readme_accuracy_summary_is_the_docs_tables():
    import accuracy

    full = _block((REPO / "docs" / "accuracy.md").read_text(), "accuracy")
    assert _block(README.read_text(), "accuracy-summary") == accuracy.summary(full), \
        "README's accuracy summary is stale: python tests/bench/accuracy.py --write-docs"


def test_docs_accuracy_table_is_current(monkeypatch):
    """One case of the table recomputed by the generator (the CPU reference) equals its rows in
    docs/accuracy.md; every case, head dim and causality has its row."""
    pytest.importorskip("torch")
    import accuracy
    import attention_cases as ac

    page = (REPO / "docs" / "accuracy.md").read_text()
    stamp = accuracy.DIGEST.search(page)
    assert stamp and stamp.group(1) == accuracy.digest(_block(page, "accuracy")), \
        ("docs/accuracy.md's table was edited by hand, or the reference, the cases or the generator changed "
         "since it was computed: python tests/bench/accuracy.py --write-docs")
    block = _block(page, "accuracy").splitlines()
    full = [line for line in block if line.startswith("|")]
    assert block[-1].startswith("The accuracy options against the defaults"), block[-1]  # accuracy.floors
    keys = [tuple(c.strip() for c in r.strip("|").split("|")[:3]) for r in full[2:]]
    assert keys == [(accuracy.LABELS[c], str(d), k) for c in ac.CASES for d in (64, 128) for k in ("no", "yes")]
    monkeypatch.setattr(ac, "CASES", [ac.CASES[0]])
    fresh = [line for line in accuracy.table(accuracy.measure(accuracy._reference(), gpu=False), gpu=False).splitlines()
             if line.startswith("|")]
    assert fresh[:2] == full[:2], "the table's columns changed: python tests/bench/accuracy.py --write-docs"
    assert fresh[2:] == full[2:6], "docs/accuracy.md is stale: python tests/bench/accuracy.py --write-docs"
