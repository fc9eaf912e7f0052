"""``python -m sageattn3``: the diagnosis (see ``sageattn3._diagnose``); ``python -m sageattn3
which``: the pip command for the wheel that fits a torch (see ``sageattn3._which``)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from sageattn3 import _diagnose as dg


def _json_target_problem(path: str | None) -> str | None:
    """Why --json PATH cannot be written (checked before the run, which can take a minute)."""
    if path is None or path == "-":
        return None
    if os.path.isdir(path):
        return f"--json {path}: that is a directory; give a file name, e.g. {os.path.join(path, 'sageattn3-report.json')}"
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        return f"--json {path}: the folder {parent} does not exist"
    if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        return f"--json {path}: not writable here; give a path you can write to"
    return None


def _write_json(path: str, data: dict) -> None:
    text = json.dumps(dg.finite_json(data), indent=2, sort_keys=False) + "\n"
    if path == "-":
        sys.stdout.write(text)
        return
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def _codes() -> str:
    return "exit status:\n" + "\n".join(f"  {c}  {m}" for c, m in dg.EXIT_CODES.items())


def which_main(argv: list[str]) -> int:
    import torch

    from sageattn3 import _guard, _which

    ap = argparse.ArgumentParser(
        prog="python -m sageattn3 which",
        description="The pip command that installs the sageattn3 wheel for a torch (default: the torch in this "
                    "environment), from the pages the installed wheel's index serves; the picker URL and the "
                    "reason when there is none.",
        epilog="exit status: 0 a page exists (command printed) or the installed wheel already fits; "
               "3 no page for that torch (picker URL printed); 2 bad arguments",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--torch", metavar="VERSION", help="a torch version instead of this environment's, e.g. 2.14.1+cu130")
    ap.add_argument("--cuda", metavar="X.Y", help="the CUDA of that torch when its version has no +cuXYZ label, e.g. 13.0")
    ap.add_argument("--json", metavar="FILE", help="also write the answer as JSON ('-' for stdout)")
    a = ap.parse_args(argv)
    if problem := _json_target_problem(a.json):
        ap.error(problem)
    try:
        spec = _which.torch_spec(a.torch or torch.__version__, a.cuda,
                                 running=(torch.__version__, torch.version.cuda))
    except _which.TorchVersionError as e:
        ap.error(str(e))
    ans = _which.answer(spec, _guard.build_record())
    if a.json:
        _write_json(a.json, ans.as_dict())
    if a.json != "-":
        print(ans.text())
    return 0 if ans.found or ans.installed_serves else dg.EXIT_NO_FP4


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["which"]:
        return which_main(argv[1:])
    ap = argparse.ArgumentParser(
        prog="python -m sageattn3",
        description="Diagnose this sageattn3 installation: environment, the installed wheel and whether it fits "
                    "this torch and these GPUs, the path sageattn3_blackwell takes on each GPU and why, the FP4 "
                    "self-check, accuracy and speed. Attach the --json file to a bug report. "
                    "Subcommand: `which` (the pip command for the wheel that fits your torch).",
        epilog=_codes(), formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", metavar="FILE", help="write the report as JSON to FILE ('-' for stdout)")
    ap.add_argument("--quick", action="store_true", help="small accuracy shapes and one speed shape (a few seconds)")
    ap.add_argument("--no-speed", action="store_true", help="skip the speed section")
    ap.add_argument("--no-accuracy", action="store_true", help="skip the accuracy section")
    a = ap.parse_args(argv)
    if problem := _json_target_problem(a.json):
        ap.error(problem)
    report = dg.diagnose(quick=a.quick, accuracy=not a.no_accuracy, speed=not a.no_speed)
    if a.json != "-":
        print(dg.format_report(report), flush=True)
    if a.json:
        try:
            _write_json(a.json, report)
        except OSError as e:
            print(f"python -m sageattn3: could not write {a.json}: {e}", file=sys.stderr)
            return dg.EXIT_USAGE
        if a.json != "-":
            print(f"report written to {a.json}: attach it to your issue")
    return report["status"]["code"]


if __name__ == "__main__":
    sys.exit(main())
