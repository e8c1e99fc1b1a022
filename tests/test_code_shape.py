"""The runtime packages stay readable: no function longer than 60 lines, no
class longer than 250, no function taking more than 8 parameters (self and
cls not counted; a record reads better past that). Computed from the source
with `ast`; the generated gRPC stubs are not ours and are left out."""

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = ("specd_core", "drafter_svc", "verifier_svc", "orchestrator", "specd")
MAX_FUNCTION_LINES = 60
MAX_CLASS_LINES = 250
MAX_PARAMETERS = 8


def _parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = fn.args
    names = [*a.posonlyargs, *a.args, *a.kwonlyargs]
    n = len(names) + (a.vararg is not None) + (a.kwarg is not None)
    return n - (1 if names and names[0].arg in ("self", "cls") else 0)


def shape_violations(root: Path = ROOT, packages: tuple[str, ...] = RUNTIME) -> list[str]:
    out = []
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel.startswith("specd_core/api/"):
                continue
            for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
                lines = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
                where = f"{rel}:{getattr(node, 'lineno', 0)} {getattr(node, 'name', '')}"
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    if lines > MAX_FUNCTION_LINES:
                        out.append(f"{where}: {lines} lines")
                    if _parameters(node) > MAX_PARAMETERS:
                        out.append(f"{where}: {_parameters(node)} parameters")
                elif isinstance(node, ast.ClassDef) and lines > MAX_CLASS_LINES:
                    out.append(f"{where}: class of {lines} lines")
    return out


def test_runtime_functions_and_classes_stay_small():
    bad = shape_violations()
    assert not bad, "\n".join(bad)


def test_the_check_sees_what_it_limits(tmp_path):
    pkg = tmp_path / "specd"
    pkg.mkdir()
    long_body = "\n".join(f"    x{i} = {i}" for i in range(61))
    (pkg / "m.py").write_text(
        f"def long():\n{long_body}\n\n"
        "def wide(a, b, c, d, e, f, g, h, i):\n    pass\n\n"
        "class Fine:\n    def method(self, a, b, c, d, e, f, g, h):\n        pass\n"
    )
    bad = shape_violations(tmp_path, ("specd",))
    assert len(bad) == 2 and "long: 62 lines" in bad[0] and "wide: 9 parameters" in bad[1], bad
