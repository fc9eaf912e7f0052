"""The layers of ``ci/``, bottom to top, as data: a module may import from its own layer and the
layers below it, never from one above (``tests/test_module_graph.py`` reads every import, inside
functions too). The table in ``docs/architecture.md`` is generated from :data:`LAYERS`
(``python -m ci architecture --write-docs``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CI = Path(__file__).resolve().parents[1]
ROOT = "ci"  # the package root (ci/__init__.py: the Python version check); below every layer, imports nothing
DOC = CI.parent / "docs" / "architecture.md"


@dataclass(frozen=True)
class Layer:
    name: str
    packages: tuple[str, ...]  # dotted names; a module belongs to the longest one it starts with
    what: str


LAYERS = (
    Layer("payload", ("ci.payload",),
          "the payload's interface: `sageattn3/build_profile.py`, `build_commands.py` and where the payload lies, "
          "loaded once"),
    Layer("runtime", ("ci.runtime",),
          "what every module runs inside: the process environment (read only here), errors and exit codes, progress lines, "
          "pip's environment, file helpers"),
    Layer("toolchain", ("ci.toolchain",),
          "the matrix and what a target needs: targets and variants, Python/CUDA/CUTLASS found or provisioned, "
          "torch sources, flags, patches, cross and Windows toolchains, the compile gate on every torch line"),
    Layer("stages", ("ci.stages", "ci.index"),
          "plan and resolve, then build, repair, tag (the build record), verify and index, each leaving an "
          "artifact on disk; the pipeline that runs them; what ties a wheel to the job that verified it"),
    Layer("release", ("ci.release",),
          "the release pipeline: cibuildwheel's hooks and jobs, the workflow's steps, the dry run, publishing "
          "(GitHub Releases, the Pages branch and its docs site, a PyPI-compatible server)"),
    Layer("checks", ("ci.checks", "ci.__main__"),
          "checks and cost tools: coverage and its evidence, the MSVC gate, the classic-unit link, kernel cost, "
          "benchmarks, cleaning up; `python -m ci` on top"),
)


def module_names(root: Path = CI) -> dict[str, Path]:
    """Every module of ``ci/`` by dotted name (a package by its ``__init__``)."""
    out = {}
    for f in sorted(root.rglob("*.py")):
        parts = f.relative_to(root.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def layer_of(module: str) -> int:
    """The index of ``module``'s layer in :data:`LAYERS` (-1: the package root); ValueError when
    no layer declares it."""
    if module == ROOT:
        return -1
    best = max(((len(p), i) for i, layer in enumerate(LAYERS) for p in layer.packages
                if module == p or module.startswith(p + ".")), default=None)
    if best is None:
        raise ValueError(f"{module} is in no layer of ci/checks/layers.py: move it under a layer's package "
                         f"or declare its package there")
    return best[1]


def upward_arrows(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """The imports of ``graph`` (module -> the modules it imports) that go from a lower layer to a
    higher one."""
    return sorted((m, d) for m, deps in graph.items() for d in deps if layer_of(d) > layer_of(m))


def _entry(module: str, layer: Layer, root: Path) -> str | None:
    """How the table names ``module`` in ``layer``: a module or subpackage right under the layer's
    own package (a subpackage as ``name/``), or another package the layer declares as itself."""
    first, *others = layer.packages
    if module.startswith(first + "."):
        name = module[len(first) + 1:].split(".")[0]
        return f"{name}/" if (root.parent / first.replace(".", "/") / name).is_dir() else name
    for p in others:
        if module == p or module.startswith(p + "."):
            return f"{p.removeprefix('ci.')}" + ("/" if (root.parent / p.replace(".", "/")).is_dir() else "")
    return None


def layer_table(root: Path = CI) -> str:
    """The markdown table of the layers, bottom row first, with the modules each holds now."""
    modules = module_names(root)
    rows = ["| layer | where | what lives there | modules |", "| --- | --- | --- | --- |"]
    for i, layer in enumerate(LAYERS, 1):
        where = ", ".join(f"`{p.replace('.', '/')}{'.py' if p.endswith('__main__') else '/'}`" for p in layer.packages)
        parts = sorted({n for m in modules if layer_of(m) == i - 1 and (n := _entry(m, layer, root))})
        rows.append(f"| {i}. {layer.name} | {where} | {layer.what} | {', '.join(f'`{n}`' for n in parts)} |")
    return "\n".join(rows)


def write_docs(path: Path = DOC) -> bool:
    """Write the generated table into ``path``'s ``layers`` block; True if it changed."""
    from ci.checks.coverage import write_block

    return write_block(path, "layers", layer_table())
