"""specd's subpackages are layers: the import graph between them (computed from
the source with `ast`, imports inside functions included) obeys the allowed
layering below, and docs/architecture.md's mermaid graph lists exactly the
edges found. Pure and fast: nothing of specd is imported."""

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "specd"
LAYERS = ("errors", "rules", "runtime", "telemetry", "api", "net", "drafter", "verifier", "orchestrator", "ops")

# What each layer may import (besides itself). The services never import each
# other; only ops (and specd/__main__.py) may import ops.
BASE = {"errors", "rules", "runtime", "telemetry", "api", "net"}
ALLOWED = {
    "errors": set(),
    "rules": {"errors"},
    "runtime": {"errors", "rules"},
    "telemetry": {"errors"},
    "api": set(),
    "net": {"errors", "rules", "runtime", "telemetry", "api"},
    "drafter": BASE,
    "verifier": BASE,
    "orchestrator": BASE,
    "ops": set(LAYERS) - {"ops"},
}
# Third-party packages a layer must not import.
FORBIDDEN = {
    "rules": {"grpc", "transformers"},
    "runtime": {"grpc"},
}


def _layer(path: Path) -> str:
    """The layer of a file under specd/: its subpackage, or the module name of a
    top-level file (errors.py -> errors, __main__.py -> __main__)."""
    first = path.relative_to(PKG).parts[0]
    return first[:-3] if first.endswith(".py") else first


def _imported_modules(path: Path) -> list[str]:
    """Absolute names of every module an import in `path` names (at any depth,
    relative imports resolved; `from specd import x` gives specd.x)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = list(path.relative_to(ROOT).with_suffix("").parts)
    if path.name != "__init__.py":
        package = package[:-1]
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            if node.module is None or module == "specd":
                names += [f"{module}.{a.name}" for a in node.names]
            else:
                names.append(module)
    return names


def _sources() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


def import_graph() -> dict[str, set[str]]:
    """Layer -> the other specd layers it imports."""
    graph: dict[str, set[str]] = {}
    for path in _sources():
        src = _layer(path)
        for name in _imported_modules(path):
            parts = name.split(".")
            if parts[0] == "specd" and len(parts) > 1 and parts[1] != src:
                graph.setdefault(src, set()).add(parts[1])
    return graph


def mermaid_edges() -> set[tuple[str, str]]:
    """The `A --> B` lines of docs/architecture.md's mermaid `graph` block."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    blocks = [b for b in re.findall(r"```mermaid\n(.*?)```", text, re.S) if b.lstrip().startswith("graph")]
    assert len(blocks) == 1, f"expected one mermaid `graph` block in docs/architecture.md, found {len(blocks)}"
    return set(re.findall(r"^\s*(\w+)\s*-->\s*(\w+)\s*$", blocks[0], re.M))


def test_every_file_is_in_a_known_layer():
    unknown = {_layer(p) for p in _sources()} - set(LAYERS) - {"__init__", "__main__"}
    assert not unknown, f"files outside the declared layers: {sorted(unknown)}"


def test_imports_obey_the_layering():
    graph = import_graph()
    main = graph.pop("__main__", set())
    assert main <= {"ops"}, f"specd/__main__.py imports {sorted(main)}"
    assert "__init__" not in graph, f"specd/__init__.py imports {sorted(graph['__init__'])}"
    bad = sorted((a, b) for a, deps in graph.items() for b in deps if b not in ALLOWED[a])
    assert not bad, f"imports across the layering: {bad}"


def test_no_forbidden_third_party_imports():
    bad = []
    for path in _sources():
        banned = FORBIDDEN.get(_layer(path), set())
        for name in _imported_modules(path):
            if name.split(".")[0] in banned:
                bad.append(f"{path.relative_to(ROOT)}: {name}")
    assert not bad, bad


def test_architecture_doc_graph_matches_the_imports():
    graph = import_graph()
    graph.pop("__main__", None)
    found = {(a, b) for a, deps in graph.items() for b in deps}
    drawn = mermaid_edges()
    assert drawn == found, (
        f"docs/architecture.md's graph misses {sorted(found - drawn)} "
        f"and lists {sorted(drawn - found)} that are not imports"
    )
