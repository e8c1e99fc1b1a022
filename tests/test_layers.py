"""specd's packages are layers: the import graph between them (computed from
the source with `ast`, imports inside functions included) obeys the allowed
layering below, and docs/architecture.md's mermaid graph lists exactly the
edges found. Pure and fast: nothing of specd is imported.

The top level is the specified layout: `specd_core` (what the services share,
itself layered: errors, rules, runtime, telemetry, api, net), the three service
packages `drafter_svc`, `verifier_svc` and `orchestrator`, and `specd` (the
command and its operations) on top. Inside `orchestrator`, its sub-packages are
layers too (`ORCHESTRATOR_ALLOWED`)."""

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
CORE = "specd_core"
CORE_LAYERS = ("errors", "rules", "runtime", "telemetry", "api", "net")
SERVICES = ("drafter_svc", "verifier_svc", "orchestrator")
TOP = (CORE, *SERVICES, "specd")
LAYERS = (*CORE_LAYERS, *SERVICES, "specd")

# What each layer may import (besides itself). The services never import each
# other; only specd (the command) imports the services together.
BASE = set(CORE_LAYERS)
ALLOWED = {
    "errors": set(),
    "rules": {"errors"},
    "runtime": {"errors", "rules"},
    "telemetry": {"errors"},
    "api": set(),
    "net": {"errors", "rules", "runtime", "telemetry", "api"},
    "drafter_svc": BASE,
    "verifier_svc": BASE,
    "orchestrator": BASE,
    "specd": set(LAYERS) - {"specd"},
}
# Third-party packages a layer must not import.
FORBIDDEN = {
    "rules": {"grpc", "transformers"},
    "runtime": {"grpc"},
}

# The orchestrator by role, bottom to top: its settings; the cycle (one request's
# loop and what it is made of); the fleet (replica pools, their clients, failover,
# scaling, peers); the reports of both (traces, metrics); the core that admits a
# request and runs it on the fleet; the edges (gRPC and HTTP servers, request
# parsing), and the process entry.
ORCHESTRATOR_ALLOWED = {
    "settings": set(),
    "cycle": {"settings"},
    "fleet": {"settings", "cycle"},
    "report": {"settings", "cycle", "fleet"},
    "core": {"settings", "cycle", "fleet", "report"},
    "edge": {"settings", "cycle", "fleet", "report", "core"},
    "__main__": {"settings", "edge"},
}
# The modules at the top of orchestrator/ that are not sub-packages, by layer.
ORCHESTRATOR_MODULES = {
    "config": "settings",
    "spec_config": "settings",
    "pair": "core",
    "model": "core",
    "core": "core",
}


def _layer(path: Path) -> str:
    """The layer of a source file: a top-level package, or a sub-package of
    specd_core (errors.py -> errors)."""
    parts = path.relative_to(ROOT).parts
    if parts[0] != CORE:
        return parts[0]
    first = parts[1]
    return first[:-3] if first.endswith(".py") else first


def _imported_modules(path: Path, top_level: bool = False) -> list[str]:
    """Absolute names of every module an import in `path` names (at any depth,
    or with `top_level` only those run when the module loads; relative imports
    resolved; `from pkg import x` gives pkg.x)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = list(path.relative_to(ROOT).with_suffix("").parts)
    if path.name != "__init__.py":
        package = package[:-1]
    names = []
    for node in tree.body if top_level else ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            if node.module is None or module in TOP:
                names += [f"{module}.{a.name}" for a in node.names]
            else:
                names.append(module)
    return names


def _name_layer(name: str) -> str | None:
    parts = name.split(".")
    if parts[0] == CORE:
        return parts[1] if len(parts) > 1 else None
    return parts[0] if parts[0] in TOP else None


def _sources(top: tuple[str, ...] = TOP) -> list[Path]:
    return sorted(p for t in top for p in (ROOT / t).rglob("*.py") if "__pycache__" not in p.parts)


def import_graph() -> dict[str, set[str]]:
    """Layer -> the other layers it imports."""
    graph: dict[str, set[str]] = {}
    for path in _sources():
        src = _layer(path)
        for name in _imported_modules(path):
            dst = _name_layer(name)
            if dst is not None and dst != src:
                graph.setdefault(src, set()).add(dst)
    return graph


def _orchestrator_layer(path_or_name: Path | str) -> str | None:
    if isinstance(path_or_name, Path):
        parts = path_or_name.relative_to(ROOT / "orchestrator").with_suffix("").parts
    else:
        parts = tuple(path_or_name.split(".")[1:])
        if path_or_name.split(".")[0] != "orchestrator":
            return None
    if not parts or parts[0] == "__init__":
        return None
    return ORCHESTRATOR_MODULES.get(parts[0], parts[0])


def orchestrator_graph() -> dict[str, set[str]]:
    """Orchestrator sub-layer -> the other sub-layers it imports."""
    graph: dict[str, set[str]] = {}
    for path in _sources(("orchestrator",)):
        src = _orchestrator_layer(path)
        for name in _imported_modules(path):
            dst = _orchestrator_layer(name)
            if src is not None and dst is not None and dst != src:
                graph.setdefault(src, set()).add(dst)
    return graph


def mermaid_edges() -> set[tuple[str, str]]:
    """The `A --> B` lines of docs/architecture.md's mermaid `graph` block."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    blocks = [b for b in re.findall(r"```mermaid\n(.*?)```", text, re.S) if b.lstrip().startswith("graph")]
    assert len(blocks) == 1, f"expected one mermaid `graph` block in docs/architecture.md, found {len(blocks)}"
    return set(re.findall(r"^\s*(\w+)\s*-->\s*(\w+)\s*$", blocks[0], re.M))


def test_the_top_level_is_the_specified_layout():
    for name in ("protos", "drafter_svc", "verifier_svc", "orchestrator", "deploy", "tests"):
        assert (ROOT / name).is_dir(), name
    for name in ("pyproject.toml", "README.md"):
        assert (ROOT / name).is_file(), name
    for pkg in SERVICES:
        assert (ROOT / pkg / "__main__.py").is_file(), f"python -m {pkg} has no entry"


def test_every_file_is_in_a_known_layer():
    unknown = {_layer(p) for p in _sources()} - set(LAYERS) - {"__init__"}
    assert not unknown, f"files outside the declared layers: {sorted(unknown)}"
    sub = {_orchestrator_layer(p) for p in _sources(("orchestrator",))} - {None}
    assert sub <= set(ORCHESTRATOR_ALLOWED), f"orchestrator modules outside its layers: {sorted(sub)}"


def test_imports_obey_the_layering():
    graph = import_graph()
    assert "__init__" not in graph, f"specd_core/__init__.py imports {sorted(graph['__init__'])}"
    bad = sorted((a, b) for a, deps in graph.items() for b in deps if b not in ALLOWED[a])
    assert not bad, f"imports across the layering: {bad}"


def test_the_orchestrator_is_layered_by_role():
    graph = orchestrator_graph()
    bad = sorted((a, b) for a, deps in graph.items() for b in deps if b not in ORCHESTRATOR_ALLOWED[a])
    assert not bad, f"orchestrator imports across its layering: {bad}"


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
    found = {(a, b) for a, deps in graph.items() for b in deps}
    drawn = mermaid_edges()
    assert drawn == found, (
        f"docs/architecture.md's graph misses {sorted(found - drawn)} "
        f"and lists {sorted(drawn - found)} that are not imports"
    )


def _layout_rows() -> dict[str, str]:
    """docs/architecture.md's layout table: path -> what the row says."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    return dict(re.findall(r"^\| `([\w./]+)` \| (.*) \|$", text, re.M))


def test_the_layout_table_lists_every_module():
    """Each module is named (in backticks) on the row of its own path or of the
    nearest folder above it that has a row, so a new module cannot go undocumented."""
    rows = _layout_rows()
    missing = []
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        if path.name == "__init__.py" or rel.startswith(f"{CORE}/api/"):
            continue
        if rel in rows:
            continue
        parts = rel.split("/")
        folders = ["/".join(parts[:i]) + "/" for i in range(len(parts) - 1, 0, -1)]
        row = next((rows[f] for f in folders if f in rows), None)
        if row is None or not re.search(rf"`{re.escape(path.stem)}[`/]", row):
            missing.append(rel)
    assert not missing, f"docs/architecture.md's layout table does not name {missing}"


def _module_path(name: str) -> Path | None:
    """The source file of a specd module name (None for third-party ones)."""
    base = ROOT.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _top_level_imports(path: Path) -> list[str]:
    """Modules `path` imports when it loads, with the packages above each,
    which Python loads first."""
    return [".".join(n.split(".")[:i]) for n in _imported_modules(path, top_level=True)
            for i in range(1, n.count(".") + 2)]


def test_the_command_line_loads_without_torch():
    """`specd status`, `scale`, `down`, `generate` and `--help` do not load torch
    or transformers (two to three seconds of CPU each on a small machine):
    nothing the `specd` command imports at load time imports them at its top.
    Commands that need a model (`up`'s pair check, `bench`) import it inside."""
    seen, todo, chains = set(), ["specd.__main__"], {"specd.__main__": "specd.__main__"}
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = _module_path(name)
        if path is None:
            continue
        for dep in _top_level_imports(path):
            chains.setdefault(dep, f"{chains[name]} -> {dep}")
            todo.append(dep)
    heavy = sorted(chains[n] for n in seen if n.split(".")[0] in {"torch", "transformers"})
    assert not heavy, "\n".join(heavy)
