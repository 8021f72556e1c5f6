"""The dependency direction: deployments -> flows -> tasks -> eagle3, never back."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {"prefect", "tasks", "flows", "deployments"}


def _imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_library_source_never_imports_the_orchestration_layer():
    offenders = {
        str(p.relative_to(ROOT)): sorted(_imported_roots(p) & FORBIDDEN) for p in sorted((ROOT / "eagle3").rglob("*.py"))
    }
    offenders = {k: v for k, v in offenders.items() if v}
    assert offenders == {}, f"eagle3/ must not import {sorted(FORBIDDEN)}: {offenders}"


def test_importing_every_library_module_loads_no_prefect():
    modules = sorted(f"eagle3.{p.stem}" for p in (ROOT / "eagle3").glob("*.py") if p.stem != "__init__")
    code = "import sys\n" + "".join(f"import {m}\n" for m in modules) + (
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in {'prefect', 'tasks', 'flows'})\nprint(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_tasks_do_not_import_flows():
    for path in sorted((ROOT / "tasks").rglob("*.py")):
        assert not (_imported_roots(path) & {"flows", "deployments"}), path
