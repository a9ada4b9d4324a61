"""The import contract: layers follow the request, and a lower layer never imports a
higher one. Read from the source with ``ast`` (the folders map onto one namespace through
pyproject's package-dir, which import-linter's graph builder does not follow)."""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

from tests.__main__ import installed_layout

# lowest first; a module may import its own layer and any layer before it
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("contracts", ("embedserve.contracts",)),
    ("config", ("embedserve.config", "embedserve.catalog",
                "embedserve.settings_errors", "embedserve.model_info", "embedserve.logs", "embedserve.nvml",
                "embedserve.http_server", "embedserve.background")),
    ("core", ("embedserve.core",)),
    ("engines", ("embedserve.engines",)),
    ("upstream", ("embedserve.upstream",)),
    ("health", ("embedserve.health",)),
    ("api", ("embedserve.gateway",)),
    ("controller", ("embedserve.controller",)),
    ("runtime", ("embedserve.runtime", "embedserve.__main__")),
]
# The load generator and the quality gate are clients: they speak the contracts and nothing
# else of the server.
CLIENT = ("embedserve.loadtest", "embedserve.loadtest.quality")
CLIENT_MAY_IMPORT = ("embedserve.contracts", "embedserve.loadtest", "embedserve.loadtest.quality")


def _matches(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def layer_of(module: str) -> int | None:
    for rank, (_, prefixes) in enumerate(LAYERS):
        if _matches(module, prefixes):
            return rank
    return None


def modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package, folder in installed_layout().items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found.setdefault(".".join([package, *parts]), path)
    return found


def imports(module: str, path: Path) -> set[str]:
    """Every module of ours this one imports, at any depth of the file."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert not node.level, f"{module}: relative import (the contract reads absolute ones)"
            base = node.module or ""
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)
    return {m for m in out if m.startswith("embedserve")}


def _type_checking_only(node: ast.AST) -> bool:
    """``if TYPE_CHECKING:``: imports for the type checker, never run."""
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def runtime_imports(path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` this file imports when it runs, at any depth (a deferred
    import inside a function still closes a cycle), ``if TYPE_CHECKING:`` blocks aside.
    ``from a.b import c`` is ``a.b.c`` when that is a module, else ``a.b``."""
    out: set[str] = set()
    pending: list[ast.AST] = [ast.parse(path.read_text())]
    while pending:
        node = pending.pop()
        if _type_checking_only(node):
            assert isinstance(node, ast.If)
            pending.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                out.add(child if child in known else node.module)
        pending.extend(ast.iter_child_nodes(node))
    return out & known


def import_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` (module -> the modules it imports), first module
    repeated at the end; empty when there is none."""
    try:
        TopologicalSorter(graph).prepare()
    except CycleError as exc:
        return list(exc.args[1])
    return []


ALL = modules()


def test_every_module_has_a_layer() -> None:
    homeless = [m for m in ALL if layer_of(m) is None and not _matches(m, CLIENT) and m != "embedserve"]
    assert homeless == []


@pytest.mark.parametrize("module", sorted(ALL))
def test_no_upward_imports(module: str) -> None:
    path = ALL[module]
    targets = {t for t in imports(module, path) if t in ALL or any(m.startswith(t + ".") for m in ALL)}
    if _matches(module, CLIENT):
        bad = sorted(t for t in targets if not _matches(t, CLIENT_MAY_IMPORT))
        assert bad == [], f"{module} (a client) imports server code: {bad}"
        return
    mine = layer_of(module)
    if mine is None:
        return
    upward = sorted(
        t for t in targets if (rank := layer_of(t)) is not None and rank > mine
    ) + sorted(t for t in targets if _matches(t, CLIENT))
    assert upward == [], f"{module} ({LAYERS[mine][0]}) imports a higher layer: {upward}"


def test_the_contract_can_fail(tmp_path: Path) -> None:
    """An engine module that imports the gateway is caught."""
    probe = tmp_path / "probe.py"
    probe.write_text("from embedserve.gateway.app import create_app\n")
    engines = layer_of("embedserve.engines.probe")
    assert engines is not None
    found = imports("embedserve.engines.probe", probe)
    assert [t for t in found if (rank := layer_of(t)) is not None and rank > engines]


def test_no_import_cycles() -> None:
    """The product's modules import in one direction: a cycle means two modules that only
    work imported in one order, or a deferred import hiding that they are one module."""
    known = set(ALL)
    graph = {module: runtime_imports(path, known) - {module} for module, path in ALL.items()}
    cycle = import_cycle(graph)
    assert cycle == [], f"import cycle: {' -> '.join(cycle)}"


def test_the_cycle_check_can_fail(tmp_path: Path) -> None:
    """A deferred import that closes a loop is found; one under TYPE_CHECKING is not."""
    first, second = tmp_path / "first.py", tmp_path / "second.py"
    first.write_text("def f():\n    from embedserve.probe.second import g\n")
    second.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import embedserve.probe.first\n"
    )
    known = {"embedserve.probe.first", "embedserve.probe.second"}
    graph = {m: runtime_imports(tmp_path / f"{m.rsplit('.', 1)[1]}.py", known) for m in known}
    assert import_cycle(graph) == []
    second.write_text("from embedserve.probe.first import f\n")
    graph = {m: runtime_imports(tmp_path / f"{m.rsplit('.', 1)[1]}.py", known) for m in known}
    assert sorted(set(import_cycle(graph))) == sorted(known)


#: Small modules with one job each.
MAX_MODULE_LINES = 400


def test_no_module_over_the_line_limit() -> None:
    long = {m: n for m, path in ALL.items() if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}, f"over {MAX_MODULE_LINES} lines, split by job: {long}"


#: The workshop stays smaller than the house: bench/ (its tests included) within this many lines
#: of Python, each file within the modules' limit.
MAX_BENCH_LINES = 5076  # rerank-gpu: two rerankers against fp32, cross-checked; hybrid-cpu; gateway-rerank;
# a load step that stops between cases at its budget; rerank-gpu's kernel step; a gateway's time per stage;
# the GEMM sweep per batch token count; --cases; a resumed step's sides started again; the engines'
# tokens and GPU time per forward pass; the QK-norm + RoPE timing, before a fused form goes into the engine


def test_the_benchmarks_stay_within_their_line_budget() -> None:
    bench = Path(__file__).resolve().parents[1] / "bench"
    lines = {str(p.relative_to(bench)): len(p.read_text().splitlines()) for p in bench.rglob("*.py")}
    long = {name: n for name, n in lines.items() if n > MAX_MODULE_LINES}
    assert long == {}, f"bench files over {MAX_MODULE_LINES} lines: {long}"
    total = sum(lines.values())
    assert total <= MAX_BENCH_LINES, f"bench/ is {total} lines of Python, over {MAX_BENCH_LINES}"
