"""The coverage table of docs/coverage.md, from evidence: per row (torch line x CUDA variant), how far each
wheel was proven and how.

Three levels, strongest first:

- **built + verified here**: a release-flavour wheel of the target was built, repaired, tagged
  and verified (fresh venv, real pip, import, ABI guard) on a development machine; its build
  record is kept in ``ci/evidence.json``;
- **proof wheel here**: the per-torch target was built in the proof flavour (the local CUDA 13
  toolkit standing in for 12.x), repaired, tagged, imported with its own torch and refused by
  another (``ci.pipeline.build_proof_wheel``); recorded the same way;
- **cross-built + verified under qemu here** (linux-aarch64): a release-flavour wheel of the target
  was cross-compiled on x86_64 (``ci.cross``), repaired with auditwheel's aarch64 policy, tagged,
  and verified with the target machine's CPython under qemu-user (``ci.emulate``): real pip from
  the local index, import with the target's torch, every op registered, the cubins of every arch,
  the ABI guard; its build record and the emulated verify's report are kept in the evidence;
- **classic unit cross-linked here** (linux-aarch64, per-torch lines): the classic unit was
  cross-compiled against the line's headers and linked against the line's aarch64 torch
  libraries from PyPI, which are a CPU build: what that build lacks is recorded
  (``python -m ci.cross link-classic``);
- **compiled vs real headers**: the torch-facing unit the row's wheels use compiles against the
  row's torch headers: the compile gate (``ci.compile_gate``), run by every ``nox -s tests`` and
  by the release plan, so every row of a passing test suite has it;

and everything else about a row (CUDA 12.x toolkits, Windows, aarch64 hardware) is proven only by
the release pipeline itself.

``python -m ci coverage --record DIR...`` adds the build records found in DIRs (``dist/wheels``,
``dist/proof``) to the evidence; ``python -m ci coverage`` prints the table docs/coverage.md
holds, and ``--write-docs`` writes it there and the brief matrix (:func:`matrix_brief`, one row
per wheel) into the README.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ci.targets import Matrix, _v
from ci.variant import Variant

EVIDENCE_FILE = Path(__file__).with_name("evidence.json")
LEVELS = {"release": "built + verified here", "proof": "proof wheel built + imported here",
          "classic_link": "classic unit cross-compiled + linked here"}


def load_evidence(path: Path = EVIDENCE_FILE) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def flavour_of(record: dict) -> str | None:
    """'release', 'proof', or None for flavours that prove nothing about a shipped wheel."""
    extra = record.get("extra") or {}
    if extra.get("mma_model"):
        return None
    return "proof" if extra.get("proof") else "release"


def record_evidence(dirs: list[Path], matrix: Matrix, path: Path = EVIDENCE_FILE) -> list[str]:
    """Add every build record (``<wheel>.json``) found in ``dirs`` to the evidence file; returns
    what was added. A record naming no target of the matrix is refused."""
    ev = load_evidence(path)
    ids = {t.id for t in matrix.targets}
    added = []
    verified = {}  # wheel -> the emulated verify's report (dist/verify/<target>.verify.json)
    for d in dirs:
        for rep_path in sorted(Path(d).glob("*.verify.json")):
            rep = json.loads(rep_path.read_text())
            verified[rep["wheel"]] = rep
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
            }
            cross = (rec.get("extra") or {}).get("cross")
            if cross:
                if rec["wheel"] not in verified:
                    raise ValueError(f"{rec_path.name}: a cross-built wheel without its emulated verify report "
                                     f"(<target>.verify.json): add the folder it is in (dist/verify)")
                v = verified[rec["wheel"]]
                entry["cross"] = cross
                entry["emulated_verify"] = {k: v[k] for k in ("machine", "python", "torch", "ops", "cubins", "abi_guard",
                                                              "timings")}
            ev.setdefault(rec["target"], {})[kind] = entry
            added.append(f"{rec['target']}: {LEVELS[kind]} ({rec['wheel']})")
    path.write_text(json.dumps(ev, indent=2, sort_keys=True) + "\n")
    return added


def record_classic_link(link: dict, matrix: Matrix, path: Path = EVIDENCE_FILE) -> str:
    """Add one ``ci.cross.ClassicLink`` (as a dict) to the evidence; returns what was added."""
    if link["target"] not in {t.id for t in matrix.targets}:
        raise ValueError(f"classic link of {link['target']!r}, which is not in the matrix")
    ev = load_evidence(path)
    ev.setdefault(link["target"], {})["classic_link"] = link
    path.write_text(json.dumps(ev, indent=2, sort_keys=True) + "\n")
    return f"{link['target']}: {LEVELS['classic_link']} ({link['torch_libraries']})"


def _describe(kind: str, e: dict) -> str:
    if kind == "classic_link":
        absent = ", ".join(e["absent_libraries"]) or "nothing"
        left = sum(len(v) for k, v in e["unresolved"].items() if not k.startswith("the Python"))
        runtime = next((n for n in e.get("needed", []) if n.startswith("libcudart")), "no CUDA runtime")
        return (f"{LEVELS[kind]} vs torch {e['torch_libraries']}; absent there: {absent}, whose {left} symbols "
                f"the unit uses stay unresolved; stand-ins: {runtime} and the kernel objects of the CUDA 13 "
                f"cross build; not imported (no CUDA build of this torch for aarch64 is reachable here)")
    if "cross" in e:
        v, c = e["emulated_verify"], e["cross"]
        return (f"cross-built on {c['built_on']} ({c['compiler'].split(' (')[0]} {c['compiler'].rsplit(' ', 1)[-1]}, "
                f"nvcc {e['nvcc']}) + verified under qemu-{v['machine']} (Python {v['python']}, torch {v['torch']}, "
                f"{len(v['ops'])} ops, cubins {'+'.join(v['cubins'])}, ABI guard)")
    return f"{LEVELS[kind]} (torch {e['torch_build']}, nvcc {e['nvcc']})"


def _row_proof(matrix: Matrix, evidence: dict, line: str, cuda: str, gate_version: str) -> str:
    parts = []
    for t in matrix.targets:
        if line in t.torch_lines and t.cuda == cuda and t.id in evidence:
            for kind in ("release", "proof", "classic_link"):
                if kind in evidence[t.id]:
                    parts.append(f"{t.os.key}: {_describe(kind, evidence[t.id][kind])}")
                    break
    parts.append(f"unit compiled vs torch {gate_version} headers")
    return "; ".join(parts) + "; the rest: release pipeline only"


def coverage_table(matrix: Matrix, evidence: dict | None = None) -> str:
    """Markdown: torch line x CUDA variant -> which wheel serves it, per OS, and how far proven."""
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
                f"{_row_proof(matrix, evidence, t.line, c, t.build_version)} |"
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


COVERAGE_DOC = Path(__file__).resolve().parent.parent / "docs" / "coverage.md"
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
