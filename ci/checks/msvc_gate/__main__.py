"""``python -m ci.checks.msvc_gate``: the command line of :mod:`ci.checks.msvc_gate`."""

from __future__ import annotations

import argparse
import sys

from ci.checks.msvc_gate import __doc__ as DOC, ATTN_UNIT, CUDA, MsvcGateError, _commit, c2719, c2872, compile_torch_unit, record, windows_lines
from ci.runtime.errors import run_main
from ci.toolchain import windows_toolchain as wintc
from ci.toolchain.targets import Matrix


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ci.checks.msvc_gate", description=DOC.split("\n\n")[0])
    ap.add_argument("--line", action="append", help="only this Windows torch line (repeatable; default: all)")
    ap.add_argument("--c2719", action="store_true", help="also compile the attention unit unpatched and patched")
    ap.add_argument("--c2872", action="store_true", help="also probe compiled_autograd.h under nvcc.exe per line")
    ap.add_argument("--no-units", action="store_true", help="skip the torch-facing units")
    ap.add_argument("--ptx-only", action="store_true", help="C2719: device code to PTX only (the host side in full)")
    ap.add_argument("--record", action="store_true", help="write the results into ci/evidence.json")
    a = ap.parse_args(argv)
    # a line no Windows target serves, a bad matrix, a missing tool, a patch that no longer applies
    # (each an InputError): "error: ..." and exit status 2
    return run_main(lambda: _cli(a))


def _cli(a) -> int:
    matrix = Matrix.load()
    lines = a.line or windows_lines(matrix)
    unknown = sorted(set(lines) - set(windows_lines(matrix)))
    if unknown:
        raise MsvcGateError(f"torch line(s) {unknown}: no Windows target of the matrix serves them "
                            f"(Windows lines: {', '.join(windows_lines(matrix))})")
    tc = wintc.resolve_windows(CUDA, matrix.line(lines[-1]).build_version)
    entries: dict[str, dict] = {}
    failed = []
    for line in lines:
        entry = entries.setdefault(line, {"torch": matrix.line(line).build_version, "msvc": tc.msvc.banner,
                                          "cuda": CUDA, "nvcc": tc.cuda.version,
                                          "built_on": "linux-x86_64 under wine"})
        if not a.no_units:
            res = compile_torch_unit(matrix, line, tc)
            entry["unit"] = res.to_dict()
            failed += [] if res.ok else [res.what]
        if a.c2872:
            entry["c2872"] = {**{k: v.to_dict() for k, v in c2872(matrix, line, tc).items()}, "from": _commit()}
    if a.c2719:
        both = c2719(matrix, tc, ptx_only=a.ptx_only)
        stable = next(t for t in matrix.targets if t.os.key == "windows-amd64" and t.variant.stable and t.cuda == CUDA)
        for line in stable.torch_lines:
            if line in entries:
                entries[line]["c2719"] = {**{k: v.to_dict() for k, v in both.items()}, "from": _commit()}
        if both["unpatched"].ok or not any("C2719" in e for e in both["unpatched"].errors):
            failed.append(f"{ATTN_UNIT} without the patch did not fail with C2719")
        if not both["patched"].ok:
            failed.append(f"{ATTN_UNIT} with the patch does not compile")
    if a.record:
        for line in record(matrix, entries):
            print(f"evidence: {line}")
    for f in failed:
        print(f"FAILED: {f}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
