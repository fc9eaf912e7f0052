"""Which wheel fits a torch: the user's side of the index, with the standard library only.

The installed wheel's build record names the index (``index_url``) and, when the factory wrote
it, every page that index serves (``extra.index_pages``: ``"cu130/torch2.14"`` = wheels that
load into torch 2.14 built for CUDA 13.x, compiled with CUDA 13.0) and the stable-ABI floor
(``extra.stable_abi_floor``: pages of torch lines from it on hold stable-ABI wheels). ``answer``
picks the page for a torch version and CUDA, or, when none exists (a CPU torch, a torch line
nothing was built for, a CUDA major without wheels, a record without the page list), points to
the picker (the index root) and says why. A torch line newer than every line of the index gets
the newest stable-ABI page of its CUDA major (those wheels load into it, untested), as the
picker page does. The ABI guard (``_guard``) gives the same advice.

A torch version without a ``+cuXYZ`` label says nothing about its CUDA: PyPI's torch 2.14.1 on
Linux x86_64 is a CUDA 13.0 build, on Windows a CPU build. Only the torch itself knows
(``torch.version.cuda``), so an unlabelled version takes the running torch's CUDA (or
``--cuda``), never "CPU" by assumption.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

PROJECT = "sageattn3"
# Where the wheels are published when a record does not say (the factory writes the real root
# into the build record: ci.stages.build.record_index_url, from SAGEATTN3_INDEX_URL, the repository, or dist/index).
DEFAULT_INDEX_URL = "https://sageattn3.github.io/sageattn3/"

_VERSION = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.\d+)*(?:(?:a|b|rc|\.dev|\.post)\d*)*(?:\+([A-Za-z0-9.]+))?\s*$")
_PAGE = re.compile(r"^cu(\d+)(\d)/torch(\d+)\.(\d+)$")
_VARIANT = re.compile(r"^cu(\d+)(\d)\.torch(\d+)\.(\d+)(\.stable)?$")


class TorchVersionError(ValueError):
    """A torch version string that cannot be read."""


@dataclass(frozen=True)
class TorchSpec:
    version: str
    line: tuple[int, int]
    cuda: str | None  # "13.0"; None: not a CUDA build
    cuda_source: str  # where the CUDA came from: "label", "--cuda", "running torch", ...
    note: str = ""  # why cuda is None (CPU, ROCm, unknown)

    @property
    def line_str(self) -> str:
        return f"{self.line[0]}.{self.line[1]}"


def cuda_tag(cuda: str) -> str:
    """'13.0' -> 'cu130'."""
    major, minor = cuda.split(".")[:2]
    return f"cu{int(major)}{int(minor)}"


def _cuda_of_tag(major: str, minor: str) -> str:
    return f"{int(major)}.{int(minor)}"


def _parse_cuda(cuda: str) -> str:
    m = re.fullmatch(r"\s*(\d+)\.(\d+)(?:\.\d+)?\s*", cuda)
    if not m:
        raise TorchVersionError(f"--cuda {cuda!r} is not a CUDA version: pass it as MAJOR.MINOR, e.g. --cuda 13.0")
    return _cuda_of_tag(m.group(1), m.group(2))


def torch_spec(version: str, cuda: str | None = None, *, running: tuple[str, str | None] | None = None) -> TorchSpec:
    """Read a torch version (``2.14.1+cu130``, ``2.14.1``, ``2.13.0+cpu``) and its CUDA.

    ``cuda`` (e.g. "13.0") wins when given. Otherwise a ``+cuXYZ`` label says it; ``+cpu`` and
    ``+rocm…`` are not CUDA builds; an unlabelled version takes the CUDA of ``running`` (the
    torch in this process: (version, torch.version.cuda)), which is the only authority on it."""
    m = _VERSION.match(version or "")
    if not m:
        raise TorchVersionError(f"{version!r} is not a torch version: pass it as e.g. --torch 2.14.1+cu130")
    line = (int(m.group(1)), int(m.group(2)))
    label = (m.group(3) or "").lower()
    version = version.strip()
    if cuda is not None:
        return TorchSpec(version, line, _parse_cuda(cuda), "--cuda")
    lm = re.fullmatch(r"cu(\d+)(\d)", label)
    if lm:
        return TorchSpec(version, line, _cuda_of_tag(lm.group(1), lm.group(2)), "version label")
    if label == "cpu":
        return TorchSpec(version, line, None, "version label", "a CPU-only build (+cpu)")
    if label.startswith("rocm"):
        return TorchSpec(version, line, None, "version label", f"a ROCm build (+{label}), not a CUDA build")
    if label:
        return TorchSpec(version, line, None, "version label", f"a build this cannot place (+{label}): pass --cuda if it is a CUDA build")
    if running is not None:
        run_version, run_cuda = running
        same = run_version.split("+")[0] == version.split("+")[0]
        if run_cuda:
            src = "running torch" if same else f"the running torch {run_version}"
            return TorchSpec(version, line, _parse_cuda(run_cuda), src)
        if same:
            return TorchSpec(version, line, None, "running torch", "a CPU-only build (torch.version.cuda is None)")
    return TorchSpec(version, line, None, "unknown",
                     f"torch {version} has no +cuXYZ label, so its CUDA is unknown here: pass --cuda "
                     f"(python -c \"import torch; print(torch.version.cuda)\" in the environment that has it)")


def index_root(record: dict | None) -> str:
    url = (record or {}).get("index_url") or DEFAULT_INDEX_URL
    return url.rstrip("/") + "/"


def index_pages(record: dict | None) -> list[str] | None:
    """The pages the index serves, from the build record (None when the record has no list)."""
    extra = (record or {}).get("extra")
    pages = extra.get("index_pages") if isinstance(extra, dict) else None
    if not isinstance(pages, (list, tuple)):
        return None
    return sorted(p.strip("/") for p in pages if isinstance(p, str) and _PAGE.match(p.strip("/")))


def stable_floor(record: dict | None) -> tuple[int, int] | None:
    """The oldest torch line served by stable-ABI wheels: the record's ``extra.stable_abi_floor``,
    else the floor of its own variant when that is a stable one; None when neither says."""
    extra = (record or {}).get("extra")
    said = extra.get("stable_abi_floor") if isinstance(extra, dict) else None
    m = re.fullmatch(r"(\d+)\.(\d+)", said) if isinstance(said, str) else None
    if m:
        return int(m.group(1)), int(m.group(2))
    v = _VARIANT.match((record or {}).get("variant") or "")
    if v and v.group(5):
        return int(v.group(3)), int(v.group(4))
    return None


def variant_problems(variant: str, spec: TorchSpec) -> list[str] | None:
    """Why a wheel of ``variant`` (``cu130.torch2.10.stable``) cannot load into that torch
    (empty: it can); None when the label is not one this reads."""
    m = _VARIANT.match(variant or "")
    if not m:
        return None
    cuda_major = int(m.group(1))
    floor = (int(m.group(3)), int(m.group(4)))
    stable = bool(m.group(5))
    problems = []
    if spec.cuda is None:
        problems.append(f"your torch is {spec.note or 'not a CUDA build'}")
    elif int(spec.cuda.split(".")[0]) != cuda_major:
        problems.append(f"your torch uses CUDA {spec.cuda}, this wheel CUDA {cuda_major}.x")
    if stable and spec.line < floor:
        problems.append(f"this wheel needs torch >= {floor[0]}.{floor[1]}")
    if not stable and spec.line != floor:
        problems.append(f"this wheel is for torch {floor[0]}.{floor[1]}.x only")
    return problems


def install_command(url: str, reinstall: bool) -> str:
    """The documented install: ``--no-deps`` so pip never touches the torch you have."""
    return f"pip install {'--force-reinstall ' if reinstall else ''}--no-deps {PROJECT} --index-url {url}"


@dataclass(frozen=True)
class Answer:
    torch_version: str
    torch_cuda: str | None
    page: str | None  # "cu130/torch2.14", or None: no page for this torch
    url: str  # the page's --index-url, or the picker (index root)
    command: str | None  # the exact pip command when a page exists
    reason: str  # why this page, or why only the picker
    installed_serves: bool | None = None  # whether the installed wheel loads into this torch (None: no record)

    @property
    def found(self) -> bool:
        return self.page is not None

    def text(self) -> str:
        if self.command:
            return f"{self.command}\n  ({self.reason})"
        return f"no wheel page for torch {self.torch_version}: {self.reason}\n  the picker lists every torch line x CUDA: {self.url}"

    def as_dict(self) -> dict:
        return asdict(self)


def _cuda_num(cuda: str) -> tuple[int, int]:
    major, minor = cuda.split(".")[:2]
    return int(major), int(minor)


def answer(spec: TorchSpec, record: dict | None, *, reinstall: bool | None = None) -> Answer:
    """The page and pip command for the torch ``spec`` describes, from ``record`` (the installed
    wheel's build record). ``reinstall``: add ``--force-reinstall`` (default: when a wheel is
    installed that does not load into that torch)."""
    root = index_root(record)
    variant = (record or {}).get("variant", "")
    probs = variant_problems(variant, spec) if record else None
    installed_serves = None if probs is None else not probs
    if reinstall is None:
        reinstall = installed_serves is False

    def picker(reason: str) -> Answer:
        return Answer(spec.version, spec.cuda, None, root, None, reason, installed_serves)

    if spec.cuda is None and spec.cuda_source == "unknown":
        return picker(spec.note)
    if spec.cuda is None:
        return picker(f"your torch {spec.version} is {spec.note}; sageattn3's kernels need a CUDA build "
                      "of torch (CUDA 12.8 or newer): install one, then pick its page")
    pages = index_pages(record)
    if pages is None:
        why = ("this wheel's build record does not list the index's pages" if record
               else "no build record (a source tree, not an installed wheel)")
        return picker(f"{why}; look up torch {spec.line_str} with CUDA {spec.cuda} in the picker")
    major, minor = _cuda_num(spec.cuda)
    parsed = []  # (torch line, cuda, page)
    for p in pages:
        m = _PAGE.match(p)
        parsed.append(((int(m.group(3)), int(m.group(4))), (int(m.group(1)), int(m.group(2))), p))
    same_line = [(cu, p) for line, cu, p in parsed if line == spec.line]
    newer = ""
    floor = stable_floor(record)
    stable = [(line, cu, p) for line, cu, p in parsed if floor is not None and line >= floor]
    if not same_line and stable and spec.line > max(line for line, _, _ in parsed):
        # A torch line newer than every one built: the stable-ABI wheels load into it (the guard
        # lets them), untested; the newest such line of torch's CUDA major, as the picker page does.
        majors = [(line, cu, p) for line, cu, p in stable if cu[0] == major]
        if not majors:
            have = ", ".join(f"CUDA {a}.{b}" for a, b in sorted({cu for _, cu, _ in stable}))
            return picker(f"no wheel for torch {spec.line_str} with CUDA {major}.x: torch {spec.line_str} is newer than "
                          f"every torch line built, and the stable-ABI wheels that load into it are published for {have}")
        top = max(line for line, _, _ in majors)
        same_line = [(cu, p) for line, cu, p in majors if line == top]
        newer = (f"; torch {spec.line_str} is newer than every torch line built: stable-ABI wheels built against "
                 f"torch {top[0]}.{top[1]}, not tested with torch {spec.line_str}")
    fits = [(cu, p) for cu, p in same_line if cu[0] == major]
    if not fits:
        if same_line:
            have = ", ".join(f"CUDA {cu[0]}.{cu[1]}" for cu, _ in sorted(same_line))
            why = f"no wheel for torch {spec.line_str} with CUDA {major}.x (torch {spec.line_str} has wheels for {have})"
        else:
            lines = sorted({(int(_PAGE.match(p).group(3)), int(_PAGE.match(p).group(4))) for p in pages})
            have = ", ".join(f"{a}.{b}" for a, b in lines) or "none"
            why = f"no wheel was published for torch {spec.line_str} (the index has pages for torch {have})"
        if installed_serves:
            why += f"; the installed wheel ({variant}) loads into this torch, so nothing needs installing"
        return picker(why)
    # Same CUDA as torch first, then the newest CUDA not newer than torch's (a newer CUDA minor
    # may need a newer runtime than the torch ships), then the oldest of the newer ones.
    want = (major, minor)
    fits.sort(key=lambda cp: (cp[0] == want, cp[0] <= want, cp[0] if cp[0] <= want else (-cp[0][0], -cp[0][1])),
              reverse=True)
    cu, page = fits[0]
    url = f"{root}{page}/"
    why = f"torch {spec.line_str} with CUDA {spec.cuda} ({spec.cuda_source})"
    if cu != want:
        why += f"; the wheels on this page were compiled with CUDA {cu[0]}.{cu[1]}"
    why += newer
    if installed_serves:
        why += f"; the installed wheel ({variant}) already loads into this torch"
    return Answer(spec.version, spec.cuda, page, url, install_command(url, reinstall), why, installed_serves)
