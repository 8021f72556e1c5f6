"""The dependency direction: deployments -> flows -> tasks -> eagle3, never back; inside eagle3,
its rooms in one order (eagle3/__init__.py and the README's Layout say why this order)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {"prefect", "tasks", "flows", "deployments"}

# eagle3's rooms, lowest first: a module may import its own room and the rooms before it, never one after.
EAGLE3_ORDER: list[tuple[str, ...]] = [
    ("eagle3.artifacts", "eagle3.fingerprint", "eagle3.storage", "eagle3.process_exit"),
    ("eagle3.gpu",),
    ("eagle3.data",),
    ("eagle3.capture",),
    ("eagle3.engine",),
    ("eagle3.draft",),
    ("eagle3.evaluate",),
    ("eagle3.online",),
    ("eagle3.train",),
    ("eagle3.config", "eagle3.stages", "eagle3.draft_stages"),
    ("eagle3.ops",),
]


def _imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_modules(path: Path, root: Path) -> set[str]:
    """Every eagle3 module `path` imports, at the top or inside a function: `from eagle3.x import y`
    counts as eagle3.x.y (y may be a module), relative imports are resolved."""
    here = _module_name(path, root)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            found |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in found if m.split(".")[0] == "eagle3"}


def _room(module: str) -> int | None:
    for rank, prefixes in enumerate(EAGLE3_ORDER):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    return None


def upward_imports(root: Path) -> list[str]:
    """'importer -> imported' for each import of a later room (or of a module in no room)."""
    bad = []
    for path in sorted((root / "eagle3").rglob("*.py")):
        here = _module_name(path, root)
        mine = _room(here)
        if mine is None:
            if here != "eagle3":
                bad.append(f"{here}: in no room of EAGLE3_ORDER")
            continue
        for target in sorted(_imported_modules(path, root)):
            theirs = _room(target)
            if target == "eagle3" or theirs is None or theirs > mine:
                bad.append(f"{here} -> {target}")
    return bad


def test_library_source_never_imports_the_orchestration_layer():
    offenders = {
        str(p.relative_to(ROOT)): sorted(_imported_roots(p) & FORBIDDEN) for p in sorted((ROOT / "eagle3").rglob("*.py"))
    }
    offenders = {k: v for k, v in offenders.items() if v}
    assert offenders == {}, f"eagle3/ must not import {sorted(FORBIDDEN)}: {offenders}"


def test_eagle3_rooms_import_one_way_only():
    assert upward_imports(ROOT) == [], f"imports against the order {EAGLE3_ORDER}"


def test_an_upward_import_is_caught(tmp_path):
    """The check above can fail: a copy of eagle3/ with one deliberate upward import is refused."""
    copy = tmp_path / "eagle3"
    for src in (ROOT / "eagle3").rglob("*.py"):
        dst = copy / src.relative_to(ROOT / "eagle3")
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text(src.read_text())
    assert upward_imports(tmp_path) == []
    target_py = copy / "data" / "target.py"
    target_py.write_text(target_py.read_text() + "\n\ndef _late():\n    from eagle3.capture.layers import resolve_decoder_stack\n")
    (copy / "gpu" / "nvml.py").write_text((copy / "gpu" / "nvml.py").read_text() + "\nfrom ..draft import model\n")
    assert upward_imports(tmp_path) == [
        "eagle3.data.target -> eagle3.capture.layers.resolve_decoder_stack",
        "eagle3.gpu.nvml -> eagle3.draft.model",
    ]


def test_importing_every_library_module_loads_no_prefect():
    modules = sorted(_module_name(p, ROOT) for p in (ROOT / "eagle3").rglob("*.py"))
    code = "import sys\n" + "".join(f"import {m}\n" for m in modules) + (
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in {'prefect', 'tasks', 'flows'})\nprint(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_the_cli_reads_and_checks_settings_without_transformers_or_torch_compile():
    """`eagle3` reads and checks the settings (eagle3.config) before it runs anything, and a refused setting is one
    error line: that path imports neither transformers (2.6 s here) nor torch's compiler (1 s), which only the
    stages that build a model or train need. With both it took 5.0-5.4 s to refuse a setting on a 2-core Xeon;
    without them 1.9-2.0 s (2026-12-06)."""
    code = ("import sys, eagle3.config, flows.cli\n"
            "print(sorted({m.split('.')[0] if m.startswith('transformers') else m for m in sys.modules\n"
            "              if m.startswith('transformers') or m.startswith('torch._dynamo')}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
    done = subprocess.run([sys.executable, "-m", "flows.cli", "run", "--preset", "tiny", "--set", "train.nosuch=1"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 2 and "train.nosuch: unknown setting" in done.stderr, done.stderr[-2000:]


def test_tasks_do_not_import_flows():
    for path in sorted((ROOT / "tasks").rglob("*.py")):
        assert not (_imported_roots(path) & {"flows", "deployments"}), path


def import_circles(root: Path, package: str, modules_of) -> list[list[str]]:  # noqa: ANN001 - a function
    """The import circles among the modules of `root/package` (every import, at the top or inside a function, counts):
    each as the list of modules around it. `modules_of(path)` gives the modules a file imports."""
    names = {_module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}
    graph = {name: set() for name in names}
    for name, path in names.items():
        for target in modules_of(path):
            while target and target not in names:  # `from a.b import c` names a.b.c: c may be a class of a.b
                target = target.rpartition(".")[0]
            if target and target != name and not names[target].name == "__init__.py":
                graph[name].add(target)
    circles, done, stack = [], set(), []

    def visit(node: str) -> None:
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt in stack:
                circles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in done:
                visit(nxt)
        stack.pop()
        done.add(node)

    for node in sorted(graph):
        if node not in done:
            visit(node)
    return circles


def _benchmark_imports(path: Path) -> set[str]:
    """The benchmarks a benchmark script imports (they import one another by bare name, from benchmarks/)."""
    scripts = {p.stem for p in path.parent.glob("*.py")}
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in scripts:
            found.add(node.value)  # importlib by name: spec_from_file_location("train_rig", ...)
    return {f"benchmarks.{m}" for m in found if m in scripts}


def test_no_import_circle_in_the_library_or_the_benchmarks():
    """No module of eagle3/ reaches itself through its imports, nor a benchmark script through the scripts it
    imports (a circle makes the order of imports decide what works)."""
    assert import_circles(ROOT, "eagle3", lambda p: _imported_modules(p, ROOT)) == []
    assert import_circles(ROOT, "benchmarks", _benchmark_imports) == []


def test_a_circle_is_caught(tmp_path):
    """The check above can fail: a copy of eagle3/draft with mla.py importing architecture.py again is refused."""
    for src in (ROOT / "eagle3" / "draft").glob("*.py"):
        dst = tmp_path / "eagle3" / "draft" / src.name
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text(src.read_text())
    assert import_circles(tmp_path, "eagle3", lambda p: _imported_modules(p, tmp_path)) == []
    mla = tmp_path / "eagle3" / "draft" / "mla.py"
    mla.write_text(mla.read_text() + "\n\ndef _late():\n    from eagle3.draft.architecture import resolve\n")
    assert ["eagle3.draft.architecture", "eagle3.draft.mla", "eagle3.draft.architecture"] in import_circles(
        tmp_path, "eagle3", lambda p: _imported_modules(p, tmp_path))
