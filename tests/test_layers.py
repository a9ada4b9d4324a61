"""The import contract: layers follow the request, and a lower layer never imports a
higher one. Read from the source with ``ast`` (the folders map onto one namespace through
pyproject's package-dir, which import-linter's graph builder does not follow)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.__main__ import installed_layout

# lowest first; a module may import its own layer and any layer before it
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("contracts", ("embedserve.contracts",)),
    ("config", ("embedserve.config", "embedserve.served_settings", "embedserve.catalog",
                "embedserve.settings_errors", "embedserve.model_info", "embedserve.logs", "embedserve.nvml",
                "embedserve.http_server")),
    ("core", ("embedserve.gateway.tokenize", "embedserve.gateway.admission", "embedserve.gateway.coalesce",
              "embedserve.gateway.vectors", "embedserve.gateway.scorers", "embedserve.gateway.pairs")),
    ("engines", ("embedserve.engines",)),
    ("health", ("embedserve.health",)),
    ("api", ("embedserve.gateway",)),
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
