"""Installing never changes the user's torch. The README's install commands (taken from its
"Installing" section, pointed at the generated index served on 127.0.0.1) are run
with real pip configured the way users' pips often are: an extra index (pip.conf, or
PIP_EXTRA_INDEX_URL) that serves other torch builds, newer and CPU-only. The same commands
without --no-deps show that this extra index would otherwise replace torch."""

from __future__ import annotations

import hashlib
import re
import shlex
from pathlib import Path

import pytest

from ci import index as ix
from ci.stages.record import load_records
from conftest_publish import REPO, Venv, sage_wheel, serve_dir, torch_standin

pytestmark = pytest.mark.timeout(300)

README_BASE = "https://OWNER.github.io/NAME/"
OTHER_TORCHES = ("2.99.0+cu130", "2.99.0+cpu", "2.99.0", "2.14.1+cpu", "2.13.0+cpu")


def readme_install_commands() -> list[list[str]]:
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Installing\n", 1)[1].split("\n## ", 1)[0]
    cmds = [shlex.split(ln) for ln in section.splitlines() if ln.startswith("pip install ") and "sageattn3" in ln]
    assert len(cmds) >= 2, "README's Installing section shows the --index-url and --find-links commands"
    return cmds


def _simple_index(root: Path, wheels: list[Path]) -> None:
    """A PEP 503 index of other torch builds (what a mirror or a second index serves)."""
    page = root / "simple" / "torch"
    page.mkdir(parents=True)
    anchors = []
    for w in wheels:
        (page / w.name).write_bytes(w.read_bytes())
        sha = hashlib.sha256(w.read_bytes()).hexdigest()
        anchors.append(f'<a href="{w.name.replace("+", "%2B")}#sha256={sha}">{w.name}</a><br>')
    (page / "index.html").write_text("<!DOCTYPE html><html><body>\n" + "\n".join(anchors) + "\n</body></html>\n")
    (root / "simple" / "index.html").write_text('<!DOCTYPE html><html><body><a href="torch/">torch</a></body></html>\n')


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("keeps-torch")
    wd = tmp / "w"
    sage_wheel(wd, "cu130.torch2.10.stable")
    sage_wheel(wd, "cu128.torch2.8")
    out = tmp / "idx"
    ix.write_index(load_records(wd), wd, out)
    other = tmp / "other"
    _simple_index(other, [torch_standin(tmp / "t", v) for v in OTHER_TORCHES])
    mine = tmp / "mine"
    for v in ("2.9.0+cu130", "2.14.1+cu130"):
        torch_standin(mine, v)
    with serve_dir(out) as index_url, serve_dir(other) as other_url:
        yield index_url, other_url + "simple/", mine, tmp


def _pip_configs(other: str, tmp: Path) -> list[dict[str, str]]:
    conf = tmp / "pip.conf"
    conf.write_text(f"[global]\nextra-index-url = {other}\n")
    return [{"PIP_CONFIG_FILE": str(conf)}, {"PIP_EXTRA_INDEX_URL": other}]


def _venv(tmp_path: Path, mine: Path, torch: str) -> Venv:
    venv = Venv(tmp_path / "venv")
    venv.pip("install", "--no-index", str(next(mine.glob(f"torch-{torch}-*.whl"))))
    return venv


def _localised(cmd: list[str], index_url: str) -> list[str]:
    return [a.replace(README_BASE, index_url) for a in cmd[1:]]  # drop "pip"


def test_the_readme_commands_leave_a_mismatched_torch_alone(servers, tmp_path):
    """The issue's user: torch 2.9.0+cu130, the command for cu130/torch2.14 (whose wheel
    requires torch>=2.10), pip configured with an extra index serving other torches."""
    index_url, other, mine, tmp = servers
    commands = readme_install_commands()
    for i, env in enumerate(_pip_configs(other, tmp)):
        for j, cmd in enumerate(commands):
            assert "--no-deps" in cmd, cmd
            venv = _venv(tmp_path / f"{i}-{j}", mine, "2.9.0+cu130")
            venv.pip(*_localised(cmd, index_url), env=env)
            got = venv.installed()
            assert got["torch"] == "2.9.0+cu130", (cmd, env, got)
            assert got["sageattn3"] == "1.0.0+cu130.torch2.10.stable"
    # the control: the same command without --no-deps takes a torch from the extra index
    venv = _venv(tmp_path / "control", mine, "2.9.0+cu130")
    plain = [a for a in _localised(commands[0], index_url) if a != "--no-deps"]
    venv.pip(*plain, env=_pip_configs(other, tmp)[0])
    assert venv.installed()["torch"] != "2.9.0+cu130"


def test_an_eager_upgrade_leaves_a_matching_torch_alone(servers, tmp_path):
    index_url, other, mine, tmp = servers
    cmd = _localised(readme_install_commands()[0], index_url)
    env = _pip_configs(other, tmp)[1]
    venv = _venv(tmp_path / "a", mine, "2.14.1+cu130")
    venv.pip(*cmd, "--upgrade", "--upgrade-strategy", "eager", env=env)
    got = venv.installed()
    assert got["torch"] == "2.14.1+cu130" and got["sageattn3"] == "1.0.0+cu130.torch2.10.stable"
    # the control: without --no-deps the eager upgrade replaces torch with the extra index's newest
    venv = _venv(tmp_path / "b", mine, "2.14.1+cu130")
    venv.pip(*[a for a in cmd if a != "--no-deps"], "--upgrade", "--upgrade-strategy", "eager", env=env)
    assert venv.installed()["torch"] == "2.99.0+cu130"


def test_the_picker_prints_the_readme_command(servers):
    """What the picker page (and its Python twin) prints is the README's command."""
    import json
    import urllib.request

    index_url = servers[0]
    manifest = json.loads(urllib.request.urlopen(index_url + "index.json", timeout=10).read())
    got = ix.pick(ix.picker_rows(manifest, README_BASE), "sageattn3", "2.14.1+cu130 13.0")
    readme = [" ".join(c) for c in readme_install_commands()]
    assert got["command"] in readme
    assert re.search(rf"--find-links {re.escape(got['links'])}$", readme[1])
