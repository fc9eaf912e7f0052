"""The coverage table of docs/coverage.md, from evidence: per row (torch line x CUDA variant), how far each
wheel was proven and how.

Three levels, strongest first:

- **built + verified here**: a release-flavour wheel of the target was built, repaired, tagged
  and verified (fresh venv, real pip, import, ABI guard) on a development machine; its build
  record is kept in ``ci/evidence.json``;
- **proof wheel here**: the per-torch target was built in the proof flavour (the local CUDA 13
  toolkit standing in for 12.x), repaired, tagged, imported with its own torch and refused by
  another (``ci.stages.pipeline.build_proof_wheel``); recorded the same way;
- **cross-built + verified under qemu here** (linux-aarch64): a release-flavour wheel of the target
  was cross-compiled on x86_64 (``ci.toolchain.cross``), repaired with auditwheel's aarch64 policy, tagged,
  and verified with the target machine's CPython under qemu-user (``ci.stages.emulate``): real pip from
  the local index, import with the target's torch, every op registered, the cubins of every arch,
  the ABI guard; its build record and the emulated verify's report are kept in the evidence;
- **classic unit cross-linked here** (linux-aarch64, per-torch lines): the classic unit was
  cross-compiled against the line's headers and linked against the line's aarch64 torch
  libraries from PyPI, which are a CPU build: what that build lacks is recorded
  (``python -m ci.checks.classic_link link-classic``);
- **compiled vs real headers**: the torch-facing unit the row's wheels use compiles against the
  row's torch headers: the compile gate (``ci.toolchain.compile_gate``), run by every ``nox -s tests`` and
  by the release plan, so every row of a passing test suite has it;

and everything else about a row (CUDA 12.x toolkits, Windows, aarch64 hardware) is proven only by
the release pipeline itself.

``python -m ci coverage --record DIR...`` adds the build records found in DIRs (``dist/wheels``,
``dist/proof``) to the evidence; ``python -m ci coverage`` prints the table docs/coverage.md
holds, and ``--write-docs`` writes it there and the brief matrix (:func:`matrix_brief`, one row
per wheel) into the README.

Evidence cannot go stale unseen: every record names the commit it was made from
(``source_commit``; ``dirty`` says what was uncommitted), and :data:`KINDS` names, per kind of
evidence, the paths it was made from (the payload, the patches, the factory code that builds and
checks it). A row whose evidence was made before a commit that changed any of them is marked
*stale* in the table (:func:`freshness`); a record whose commit is not in the repository's
history fails the tests (tests/test_coverage.py). Records are added by :func:`add_evidence`,
whatever made them.
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ci.toolchain.targets import Matrix, _v
from ci.toolchain.variant import Variant
from ci.runtime.errors import InputError

REPO = Path(__file__).resolve().parents[2]
EVIDENCE_FILE = REPO / "ci" / "evidence.json"

# -- what each kind of evidence was made from -------------------------------------------------
# Paths (relative to the repository root, folders included whole) whose content decides a wheel:
# the payload (sources, build_profile.py, build_commands.py, setup.py), the patches, and the
# factory code that resolves the toolchain and flags, stages, patches, compiles, repairs, tags and
# records it, with the matrix it reads the target from.
PAYLOAD_INPUTS = ("sageattn3", "patches")
WHEEL_BUILD_INPUTS = (
    "ci/targets.toml", "ci/payload", "ci/runtime", "ci/toolchain/targets.py", "ci/toolchain/variant.py", "ci/toolchain/flags.py",
    "ci/toolchain/patches", "ci/stages/resolve.py", "ci/toolchain/resolved.py", "ci/toolchain/tools",
    "ci/toolchain/torch_source.py", "ci/stages/build.py", "ci/stages/repair.py", "ci/stages/tag.py", "ci/stages/record.py",
)
# What checks a built wheel here (the verify stage and the pipeline that runs the stages).
VERIFY_INPUTS = ("ci/stages/verify.py", "ci/stages/pipeline.py")
# A cross-built wheel (a release record with ``cross``): the cross toolchain and the emulated verify.
CROSS_INPUTS = ("ci/toolchain/cross.py", "ci/toolchain/cross_spec.py", "ci/stages/emulate.py")
# A Windows wheel built on Linux: the wine toolchain, the stand-ins and inspection, the PE reader.
WINDOWS_INPUTS = ("ci/toolchain/wine.py", "ci/toolchain/windows_toolchain.py", "ci/stages/windows_build.py",
                  "ci/stages/windows_load.py", "ci/toolchain/pe.py", "ci/checks/msvc_gate", "ci/stages/emulate.py",
                  "ci/release/cibw_job.py")
# Kinds that check one part of a row besides how far its wheel was built (shown beside that).
CHECK_KINDS = ("msvc_unit",)


@dataclass(frozen=True)
class Kind:
    """One kind of evidence: how far it proves a row (the table's words), what ran on the machine
    that made it (a record may say it more precisely: ``ran_here``), and the paths a later change
    of which makes it stale."""

    label: str
    ran_here: str
    inputs: tuple[str, ...]


# The one list of evidence kinds. A new kind (a Windows build under wine, a compile-only check)
# is a new entry here, its records added with :func:`add_evidence`.
KINDS = {
    "release": Kind("built + verified here", "build, repair, tag, verify (fresh venv, real pip, import, ABI guard)",
                    PAYLOAD_INPUTS + WHEEL_BUILD_INPUTS + VERIFY_INPUTS),
    "proof": Kind("proof wheel built + imported here",
                  "proof-flavour build, repair, tag, import with its torch, refusal by another torch",
                  PAYLOAD_INPUTS + WHEEL_BUILD_INPUTS + VERIFY_INPUTS),
    "windows_wine": Kind("built under wine here",
                         "build with MSVC 14.44 and nvcc.exe under wine, delvewheel repair, tag, PE inspection, "
                         "LoadLibrary under wine against PyPI's torch DLLs",
                         PAYLOAD_INPUTS + WHEEL_BUILD_INPUTS + VERIFY_INPUTS + WINDOWS_INPUTS),
    "msvc_unit": Kind("unit compiled by cl.exe here",
                      "the torch-facing unit compiled by MSVC 14.44's cl.exe under wine against the line's "
                      "win_amd64 torch headers (python -m ci.checks.msvc_gate)",
                      PAYLOAD_INPUTS + ("ci/targets.toml", "ci/payload", "ci/toolchain/targets.py", "ci/toolchain/flags.py",
                                        "ci/checks/msvc_gate", "ci/toolchain/wine.py", "ci/toolchain/windows_toolchain.py",
                                        "ci/toolchain/patches", "ci/toolchain/compile_gate", "ci/toolchain/tools",
                                        "ci/release/cibw_job.py")),
    "classic_link": Kind("classic unit cross-compiled + linked here",
                         "cross-compile of the classic unit, link against PyPI's aarch64 CPU torch",
                         PAYLOAD_INPUTS + ("ci/targets.toml", "ci/payload", "ci/toolchain/targets.py", "ci/toolchain/flags.py",
                                           "ci/toolchain/tools", "ci/toolchain/compile_gate", "ci/release/cibw_job.py",
                                           "ci/toolchain/cross.py", "ci/toolchain/cross_spec.py", "ci/checks/classic_link")),
}


def inputs_of(kind: str, entry: dict) -> tuple[str, ...]:
    """The paths ``entry`` (evidence of ``kind``) was made from."""
    return KINDS[kind].inputs + (CROSS_INPUTS if kind == "release" and "cross" in entry else ())


class EvidenceError(InputError, ValueError):
    pass


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True)
    except OSError as e:
        raise EvidenceError(f"evidence is checked against the repository's history with git, which did not run: {e}")


def check_history(repo: Path = REPO) -> None:
    """The repository's full history is here (evidence names commits of it)."""
    proc = _git(repo, "rev-parse", "--is-shallow-repository")
    if proc.returncode != 0:
        raise EvidenceError(f"{repo} is not a git checkout ({proc.stderr.strip()}): evidence names commits, and "
                            f"whether it is current is read from the history; use a clone")
    if proc.stdout.strip() == "true":
        raise EvidenceError(f"{repo} is a shallow clone: whether evidence is current needs the full history "
                            f"(git fetch --unshallow, or clone without --depth)")


def in_history(commit: str, repo: Path = REPO) -> bool:
    """``commit`` is HEAD or one of its ancestors."""
    return (_git(repo, "cat-file", "-e", f"{commit}^{{commit}}").returncode == 0
            and _git(repo, "merge-base", "--is-ancestor", commit, "HEAD").returncode == 0)


@dataclass(frozen=True)
class Freshness:
    commit: str  # what the evidence was made from
    dirty: str | None  # uncommitted changes it was made with, as its record says
    known: bool  # the commit is in this repository's history (HEAD or an ancestor)
    changed_by: str | None  # the first later commit that changed what it was made from

    def note(self) -> str:
        short = self.commit[:7]
        if not re.fullmatch(r"[0-9a-f]{40}", self.commit):
            return "**names no commit it was made from**"
        if not self.known:
            return f"**commit {short} is not in this repository's history**"
        made = f"from {short}" + (" + uncommitted changes" if self.dirty else "")
        if self.changed_by:
            return f"**stale**: {made}, what it was made from changed in {self.changed_by[:7]}"
        return made


def freshness(entry: dict, inputs: tuple[str, ...], repo: Path = REPO) -> Freshness:
    """Is ``entry`` (an evidence record) current: was none of ``inputs`` changed by a commit of
    HEAD's history that is not in its commit's history? (``git rev-list --first-parent
    COMMIT..HEAD -- inputs``: a change merged in from another branch counts, as the merge commit
    that brought it. Along the first parents the first such commit stays the same as HEAD moves
    on, so the table's "changed in" does not shift when a later merge brings older commits.)"""
    commit = entry.get("source_commit") or ""
    check_history(repo)
    if not re.fullmatch(r"[0-9a-f]{40}", commit) or not in_history(commit, repo):
        return Freshness(commit, entry.get("dirty"), False, None)
    proc = _git(repo, "rev-list", "--reverse", "--first-parent", f"{commit}..HEAD", "--", *inputs)
    if proc.returncode != 0:
        raise EvidenceError(f"git rev-list {commit[:7]}..HEAD failed: {proc.stderr.strip()}")
    changes = proc.stdout.split()
    return Freshness(commit, entry.get("dirty"), True, changes[0] if changes else None)


def source_of(raw: str | None, inputs: tuple[str, ...], repo: Path = REPO) -> dict:
    """The ``source_commit`` (and ``dirty``) fields of a new record from the commit its maker
    reported (``<sha>``, or ``<sha>-dirty`` from ``ci.stages.build.source_commit``: uncommitted changes
    to sageattn3/ or patches/ when it was built). Uncommitted changes to ``inputs`` in the checkout
    now, when it is at that commit, are named too: the record cannot say it was made without them."""
    raw = raw or ""
    sha, dirty = (raw[: -len("-dirty")], "uncommitted changes to sageattn3/ or patches/ when built") \
        if raw.endswith("-dirty") else (raw, None)
    if not re.fullmatch(r"[0-9a-f]{40}", sha):
        raise EvidenceError(f"source commit {raw!r} is not a commit: evidence is made from a git checkout, "
                            f"and names the commit it was made from")
    check_history(repo)
    if not in_history(sha, repo):
        raise EvidenceError(f"source commit {sha[:7]} is not in this checkout's history: record evidence in the "
                            f"checkout (and branch) it was made from")
    if _git(repo, "rev-parse", "HEAD").stdout.strip() == sha:
        changed = _git(repo, "status", "--porcelain", "--", *inputs).stdout.splitlines()
        if changed:
            paths = ", ".join(sorted(ln[3:] for ln in changed))
            dirty = f"uncommitted changes to {paths}" + (f"; {dirty}" if dirty else "")
    return {"source_commit": sha, **({"dirty": dirty} if dirty else {})}


def add_evidence(target_id: str, kind: str, entry: dict, matrix: Matrix, path: Path = EVIDENCE_FILE,
                 repo: Path = REPO) -> dict:
    """Put ``entry`` (evidence of ``kind`` for the target ``target_id``) into the evidence file,
    replacing the target's earlier one of that kind; returns what was stored. ``entry`` names the
    commit it was made from (``source_commit``, see :func:`source_of`); ``ran_here`` says what
    ran (default: the kind's)."""
    if kind not in KINDS:
        raise EvidenceError(f"evidence of kind {kind!r}: the kinds are {', '.join(KINDS)} (ci/checks/coverage.py KINDS)")
    if target_id not in {t.id for t in matrix.targets}:
        raise EvidenceError(f"evidence for {target_id!r}, which is not in the matrix")
    local = re.search(r"file://[^\s\"',)]*", json.dumps(entry))
    if local:
        raise EvidenceError(f"evidence for {target_id} names {local.group(0)}, a place on the machine that made it "
                            f"(a local build's record names its own dist/index as the wheel's index): build with "
                            f"SAGEATTN3_INDEX_URL set to the published index, as the release does, and record that")
    stored = {**entry, **source_of(entry.get("source_commit"), inputs_of(kind, entry), repo)}
    stored.setdefault("ran_here", KINDS[kind].ran_here)
    ev = load_evidence(path)
    ev.setdefault(target_id, {})[kind] = stored
    path.write_text(json.dumps(ev, indent=2, sort_keys=True) + "\n")
    return stored


def load_evidence(path: Path = EVIDENCE_FILE) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def flavour_of(record: dict) -> str | None:
    """'release', 'proof', or None for flavours that prove nothing about a shipped wheel."""
    extra = record.get("extra") or {}
    if extra.get("mma_model"):
        return None
    return "proof" if extra.get("proof") else "release"


def record_evidence(dirs: list[Path], matrix: Matrix, path: Path = EVIDENCE_FILE, repo: Path = REPO) -> list[str]:
    """Add every build record (``<wheel>.json``) found in ``dirs`` to the evidence file; returns
    what was added. A record naming no target of the matrix, or no commit of this history, is
    refused (and nothing is added)."""
    ids = {t.id for t in matrix.targets}
    verified = {}  # wheel -> the emulated verify's report (dist/verify/<target>.verify.json)
    for d in dirs:
        for rep_path in sorted(Path(d).glob("*.verify.json")):
            rep = json.loads(rep_path.read_text())
            verified[rep["wheel"]] = rep
    found = []
    for d in dirs:
        for rec_path in sorted(Path(d).glob("*.whl.json")):
            rec = json.loads(rec_path.read_text())
            kind = flavour_of(rec)
            if kind is None:
                continue
            if rec.get("target") not in ids:
                raise ValueError(f"{rec_path.name}: target {rec.get('target')!r} is not in the matrix")
            entry = {
                "wheel": rec["wheel"], "sha256": rec["sha256"], "torch_build": rec["torch_build"],
                "nvcc": rec.get("toolchain", {}).get("nvcc"), "source_commit": rec.get("source_commit"),
                **({"size": rec["size"]} if rec.get("size") else {}),
            }
            cross = (rec.get("extra") or {}).get("cross")
            if cross and "wine" in cross.get("built_on", ""):  # a Windows wheel built here under wine
                if rec["wheel"] not in verified:
                    raise ValueError(f"{rec_path.name}: a Windows wheel without its inspection report "
                                     f"(<target>.verify.json): add the folder it is in (dist/verify)")
                v = verified[rec["wheel"]]
                kind = "windows_wine"
                entry["windows"] = {k: cross[k] for k in ("msvc", "nvcc", "wine", "torch", "standin_import_libraries",
                                                          "headers_from_elsewhere") if k in cross}
                entry["inspection"] = {k: v["inspection"][k] for k in ("machine", "imports", "cubins", "cuda_runtime",
                                                                       "pyinit", "build_paths")}
                entry["load"] = {"ok": v["load"]["ok"], "output": v["load"]["output"],
                                 "standin_dlls": v["load"]["standin_dlls"]}
                entry["abi_guard"] = v["abi_guard"]
            elif cross:
                if rec["wheel"] not in verified:
                    raise ValueError(f"{rec_path.name}: a cross-built wheel without its emulated verify report "
                                     f"(<target>.verify.json): add the folder it is in (dist/verify)")
                v = verified[rec["wheel"]]
                entry["cross"] = cross
                entry["emulated_verify"] = {k: v[k] for k in ("machine", "python", "torch", "ops", "cubins", "abi_guard",
                                                              "timings")}
                entry["ran_here"] = (f"cross-build on {cross['built_on']}, repair, tag, verify under "
                                     f"qemu-{v['machine']} (real pip, import, ops, cubins, ABI guard)")
            try:
                source_of(entry["source_commit"], inputs_of(kind, entry), repo)
            except EvidenceError as e:
                raise EvidenceError(f"{rec_path.name}: {e}") from None
            found.append((rec["target"], kind, entry))
    added = []
    for target_id, kind, entry in found:
        stored = add_evidence(target_id, kind, entry, matrix, path, repo)
        note = f", {stored['dirty']}" if stored.get("dirty") else ""
        added.append(f"{target_id}: {KINDS[kind].label} ({entry['wheel']}; from {stored['source_commit'][:7]}{note})")
    return added


def record_classic_link(link: dict, matrix: Matrix, path: Path = EVIDENCE_FILE, repo: Path = REPO) -> str:
    """Add one ``ci.checks.classic_link.ClassicLink`` (as a dict) to the evidence; returns what was added."""
    if link["target"] not in {t.id for t in matrix.targets}:
        raise ValueError(f"classic link of {link['target']!r}, which is not in the matrix")
    stored = add_evidence(link["target"], "classic_link", link, matrix, path, repo)
    return f"{link['target']}: {KINDS['classic_link'].label} ({link['torch_libraries']}; from {stored['source_commit'][:7]})"


def _describe(kind: str, e: dict, line: str = "") -> str:
    if kind == "classic_link":
        absent = ", ".join(e["absent_libraries"]) or "nothing"
        left = sum(len(v) for k, v in e["unresolved"].items() if not k.startswith("the Python"))
        runtime = next((n for n in e.get("needed", []) if n.startswith("libcudart")), "no CUDA runtime")
        return (f"{KINDS[kind].label} vs torch {e['torch_libraries']}; absent there: {absent}, whose {left} symbols "
                f"the unit uses stay unresolved; stand-ins: {runtime} and the kernel objects of the CUDA 13 "
                f"cross build; not imported (no CUDA build of this torch for aarch64 is reachable here)")
    size = f", {e['size']:,} bytes" if e.get("size") else ""
    if "cross" in e:
        v, c = e["emulated_verify"], e["cross"]
        return (f"cross-built on {c['built_on']} ({c['compiler'].split(' (')[0]} {c['compiler'].rsplit(' ', 1)[-1]}, "
                f"nvcc {e['nvcc']}{size}) + verified under qemu-{v['machine']} (Python {v['python']}, torch {v['torch']}, "
                f"{len(v['ops'])} ops, cubins {'+'.join(v['cubins'])}, ABI guard)")
    if kind in ("release", "proof"):
        return f"{KINDS[kind].label} (torch {e['torch_build']}, nvcc {e['nvcc']}{size})"
    if kind == "windows_wine":
        w, i = e["windows"], e["inspection"]
        standins = "+".join(sorted(w.get("standin_import_libraries", {}))) or "none"
        return (f"{KINDS[kind].label} (MSVC {w['msvc'].split('Version ')[-1].split(' ')[0]}, nvcc.exe {e['nvcc']}{size}, "
                f"stand-in import libraries {standins}), delvewheel-repaired, PE inspected (x64, PyInit__C, cubins "
                f"{'+'.join(i['cubins'])}), loaded under wine against PyPI's torch {e['torch_build']} DLLs, not imported "
                f"(no Windows CPython on these registries)")
    if kind == "msvc_unit":
        e = (e.get("lines") or {}).get(line) or {}
        if not e:
            return f"{KINDS[kind].label}: not for torch {line}"
        unit = e.get("unit") or {}
        text = (f"{KINDS[kind].label} vs torch {e['torch']} (win_amd64) headers, with CUDA {e.get('cuda', '13.0')}'s"
                + (" FAILED" if not unit.get("ok", True) else ""))
        if "c2872" in e:
            found = sorted({r["notes"] for k, r in e["c2872"].items() if k != "from"})
            text += (f", and torch/extension.h + compiled_autograd.h under nvcc.exe {e.get('cuda', '13.0')} with and "
                     f"without USE_CUDA and /Zc:preprocessor (from {e['c2872'].get('from', '?')}): {' / '.join(found)}")
        if "c2719" in e:
            c = e["c2719"]
            text += (f", and the attention unit (from {c.get('from', '?')}): C2719 without the MSVC patch, compiles with it"
                     if not c["unpatched"]["ok"] and c["patched"]["ok"] else ", and the attention unit's C2719 check FAILED")
        return text
    return f"{KINDS[kind].label}: {e['ran_here']}"


def _row_proof(matrix: Matrix, evidence: dict, line: str, cuda: str, gate_version: str, repo: Path) -> str:
    parts = []
    for t in matrix.targets:
        if not (line in t.torch_lines and t.cuda == cuda):
            continue
        if t.os.key == "windows-amd64" and _v(cuda) < _v("13.0"):
            for kind in [k for k in CHECK_KINDS if k in evidence.get(t.id, {})]:
                e = evidence[t.id][kind]
                if line in (e.get("lines") or {}):
                    parts.append(f"{t.os.key} ({freshness(e, inputs_of(kind, e), repo).note()}): "
                                 f"{_describe(kind, e, line)}")
            parts.append(f"{t.os.key}: its build release pipeline only (CUDA {cuda} for Windows is not on PyPI in "
                         f"full: no nvcc.exe)")
            continue
        if t.id not in evidence:
            continue
        built = [k for k in KINDS if k not in CHECK_KINDS and k in evidence[t.id]][:1]
        for kind in built + [k for k in CHECK_KINDS if k in evidence[t.id]]:
            e = evidence[t.id][kind]
            if kind in CHECK_KINDS and line not in (e.get("lines") or {}):
                continue
            fresh = freshness(e, inputs_of(kind, e), repo)
            parts.append(f"{t.os.key} ({fresh.note()}): {_describe(kind, e, line)}")
    parts.append(f"unit compiled vs torch {gate_version} headers")
    return "; ".join(parts) + "; the rest: release pipeline only"


def coverage_table(matrix: Matrix, evidence: dict | None = None, repo: Path = REPO) -> str:
    """Markdown: torch line x CUDA variant -> which wheel serves it, per OS, and how far proven
    (each piece of evidence with the commit it was made from, marked stale when what it was made
    from changed since: :func:`freshness` against ``repo``'s history)."""
    evidence = load_evidence() if evidence is None else evidence
    rows = ["| torch | CUDA | archs | wheel variant | Python | OS | proven |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for t in sorted(matrix.torch, key=lambda t: _v(t.line)):
        for c in t.cuda:
            stable = _v(t.line) >= _v(matrix.stable_abi_floor)
            variant = Variant(c, matrix.stable_abi_floor if stable else t.line, stable)
            py = f"{matrix.limited_api_python}+" if stable else f"{t.python[0]}–{t.python[-1]}"
            rows.append(
                f"| {t.line} | {c} | {' '.join(matrix.cuda_archs[c])} | `{variant.label}` | {py} | "
                f"{', '.join(o for o in t.os if t.builds(c, o))} | "
                f"{_row_proof(matrix, evidence, t.line, c, t.build_version, repo)} |"
            )
    return "\n".join(rows)


def matrix_brief(matrix: Matrix) -> str:
    """Markdown for the README: one row per wheel variant, with the torch lines it serves."""
    rows: dict[str, dict] = {}
    for t in sorted(matrix.torch, key=lambda t: _v(t.line)):
        for c in t.cuda:
            stable = _v(t.line) >= _v(matrix.stable_abi_floor)
            variant = Variant(c, matrix.stable_abi_floor if stable else t.line, stable)
            row = rows.setdefault(variant.label, {
                "lines": [], "cuda": c, "archs": " ".join(matrix.cuda_archs[c]), "os": [],
                "python": f"{matrix.limited_api_python}+" if stable else f"{t.python[0]}–{t.python[-1]}"})
            row["lines"].append(t.line)
            row["os"] += [o for o in t.os if t.builds(c, o) and o not in row["os"]]
    out = ["| wheel variant | torch | CUDA | archs | Python | OS |", "| --- | --- | --- | --- | --- | --- |"]
    for label, r in sorted(rows.items(), key=lambda kv: (_v(kv[1]["lines"][0]), _v(kv[1]["cuda"]))):
        lines = r["lines"][0] if len(r["lines"]) == 1 else f"{r['lines'][0]}–{r['lines'][-1]}"
        out.append(f"| `{label}` | {lines} | {r['cuda']} | {r['archs']} | {r['python']} | {', '.join(r['os'])} |")
    return "\n".join(out)


COVERAGE_DOC = REPO / "docs" / "coverage.md"
README = COVERAGE_DOC.parent.parent / "README.md"


def _block(name: str) -> re.Pattern:
    return re.compile(rf"(<!-- {name}:start -->\n)(.*?)\n?(<!-- {name}:end -->)", re.S)


def generated_block(text: str, name: str) -> str:
    """The lines between the ``<!-- NAME:start -->`` and ``<!-- NAME:end -->`` lines."""
    m = _block(name).search(text)
    if m is None:
        raise ValueError(f"no <!-- {name}:start --> ... <!-- {name}:end --> block to fill "
                         "(each marker on a line of its own)")
    return m.group(2)


def write_block(path: Path, name: str, table: str) -> bool:
    """Replace the generated block ``name`` of ``path`` with ``table``; True if it changed."""
    text = path.read_text(encoding="utf-8")
    try:
        old = generated_block(text, name)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    if old == table:
        return False
    path.write_text(_block(name).sub(lambda m: f"{m.group(1)}{table}\n{m.group(3)}", text, count=1), encoding="utf-8")
    return True
