"""benchmarks/versus.py starts each commit's stack from that commit's tree. specd
is installed in editable mode here, and the editable finder answers for any module a
tree lacks, so an earlier layout's tree (its stack in specd/ops/local_stack.py) must
not get this checkout's specd/local_stack.py."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from benchmarks.versus import HOST

pytestmark = pytest.mark.unit

FAKE_STACK = textwrap.dedent("""
    import types
    class Stack:
        def __init__(self, target, drafter, service_args):
            self.orchestrator = types.SimpleNamespace(address=__file__)
        def stop(self):
            pass
""")


def _host(tree):
    spec = json.dumps({"target": "t", "drafter": "d", "service_args": []})
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([sys.executable, "-c", HOST, spec], cwd=tree, env=env, input="", capture_output=True,
                          text=True, timeout=60)


def test_an_earlier_layout_runs_its_own_stack(tmp_path):
    (tmp_path / "specd" / "ops").mkdir(parents=True)
    (tmp_path / "specd" / "__init__.py").write_text("")
    (tmp_path / "specd" / "ops" / "__init__.py").write_text("")
    (tmp_path / "specd" / "ops" / "local_stack.py").write_text(FAKE_STACK)
    r = _host(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.split()[:2] == ["ADDRESS", str(tmp_path / "specd" / "ops" / "local_stack.py")]

