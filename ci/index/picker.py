"""The picker's decision: which page of the index serves a given torch (``torch.__version__``
and ``torch.version.cuda``). The same rules as ci/picker.js, which reads them from the picker
page's table; a test runs both on the same inputs. Users run ``python -m sageattn3 which``
where torch is installed.
"""

from __future__ import annotations

import json
import re


from ci.index.html import ASK_TORCH, _stable_flag, _url
from ci.index.layout import Page, _line_key
from ci.toolchain.variant import cuda_from_tag


def picker_rows(manifest: dict, base: str | None = None) -> list[dict[str, str]]:
    """The rows of the picker table, from a manifest (what picker.js reads from the page)."""
    base = base if base is not None else manifest.get("base_url")
    wheels = manifest.get("wheels", {})
    rows = []
    for path, names in manifest.get("pages", {}).items():
        parts = path.split("/")
        if len(parts) == 2 and parts[1].startswith("torch"):
            rows.append({"line": parts[1].removeprefix("torch"), "cuda": cuda_from_tag(parts[0]), "page": path,
                         "url": _url(base, f"{path}/"), "links": _url(base, f"links/{Page(path, ()).flat_name}.html"),
                         "stable": _stable_flag(wheels[n]["variant"] for n in names)})
    rows.sort(key=lambda r: (tuple(-x for x in _line_key(r["line"])), r["page"]))
    return rows


def _dotted(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split("."))


def _sorted_unique(values) -> str:
    return ", ".join(sorted(set(values), key=_dotted))


_TORCH_VERSION = re.compile(r"(\d+)\.(\d+)([.0-9a-z]*)(?:\+([.0-9a-z]+))?", re.I | re.A)


def pick(rows: list[dict[str, str]], project: str, text: str) -> dict[str, str]:
    """What the picker answers for what a user pasted (``torch.__version__`` and optionally
    ``torch.version.cuda``): ``kind`` ("ok" with ``command``, or why not) and ``reason``."""
    tokens = [t for t in re.split(r"[\s,]+", text.strip()) if t]
    if not tokens:
        return {"kind": "empty", "reason": f"paste what {ASK_TORCH} prints"}
    m = _TORCH_VERSION.fullmatch(tokens[0])
    if not m or len(tokens) > 2:
        return {"kind": "unparsed", "reason": f"not a torch version: {json.dumps(' '.join(tokens), ensure_ascii=False)}"
                f"; paste what {ASK_TORCH} prints, e.g. 2.14.1+cu130 13.0"}
    version, line, label = tokens[0], f"{int(m[1])}.{int(m[2])}", (m[4] or "").lower()
    cuda: str | None = None
    if label.startswith("rocm"):
        return {"kind": "rocm", "reason": f"torch {version} is a ROCm build; sageattn3 needs torch built for CUDA (NVIDIA GPUs)"}
    if len(tokens) == 2:
        c = re.fullmatch(r"(\d+)\.(\d+)", tokens[1], re.A)
        if re.fullmatch(r"none", tokens[1], re.I):
            cuda = None
        elif c:
            cuda = f"{int(c[1])}.{int(c[2])}"
        else:
            return {"kind": "unparsed", "reason": f"not a CUDA version: {json.dumps(tokens[1], ensure_ascii=False)}"
                    " (torch.version.cuda prints e.g. 13.0, or None for a CPU build)"}
    elif c := re.fullmatch(r"cu(\d+)(\d)", label, re.A):
        cuda = f"{int(c[1])}.{int(c[2])}"
    elif label != "cpu":
        return {"kind": "no-cuda", "reason": f"torch {version} does not say which CUDA it was built for; paste what "
                f"{ASK_TORCH} prints"}
    if cuda is None:
        return {"kind": "cpu", "reason": f"torch {version} is a CPU-only build; sageattn3 needs torch built for CUDA: "
                "install a CUDA build of torch, then pick again"}
    major = _dotted(cuda)[0]
    same = [r for r in rows if r["line"] == line]
    newer = ""
    stable = [r for r in rows if r["stable"] == "true"]
    if not same and stable and _dotted(line) > max(_dotted(r["line"]) for r in rows):
        # A torch line newer than every one built here: the stable-ABI wheels load into it (the
        # import guard lets them), untested; offer the newest such line of torch's CUDA major.
        majors = [r for r in stable if _dotted(r["cuda"])[0] == major]
        if not majors:
            return {"kind": "no-variant", "reason": f"no wheels for torch {line} built for CUDA {cuda}; torch {line} is "
                    f"newer than every torch line built here, and the stable-ABI wheels that load into it are served "
                    f"for CUDA {_sorted_unique(r['cuda'] for r in stable)}"}
        top = max((r["line"] for r in majors), key=_dotted)
        same = [r for r in majors if r["line"] == top]
        newer = (f"; torch {line} is newer than every torch line built here: stable-ABI wheels built against "
                 f"torch {top}, not tested with torch {line}")
    if not same:
        return {"kind": "unknown-line", "reason": f"no wheels for torch {line} on this index; it serves torch "
                f"{_sorted_unique(r['line'] for r in rows)}"}
    fits = [r for r in same if _dotted(r["cuda"])[0] == major]
    if not fits:
        return {"kind": "no-variant", "reason": f"no wheels for torch {line} built for CUDA {cuda}; torch {line} is "
                f"served for CUDA {_sorted_unique(r['cuda'] for r in same)}"}
    # Same CUDA first, else the newest not newer than torch's (a newer minor may need a newer
    # runtime than torch ships), else the oldest newer one.
    def rank(r: dict[str, str]) -> tuple:
        k = _dotted(r["cuda"])
        older = k <= _dotted(cuda)
        return (r["cuda"] == cuda, older, tuple(x if older else -x for x in k))
    best = max(fits, key=rank)
    return {"kind": "ok", "page": best["page"], "url": best["url"], "links": best["links"],
            "command": f"pip install --no-deps {project} --index-url {best['url']}",
            "reason": f"torch {line} built for CUDA {cuda}: wheels compiled with CUDA {best['cuda']}{newer}"}
