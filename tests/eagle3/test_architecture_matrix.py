"""The architecture matrix (eagle3/capture/architectures.py) against vLLM 0.32's own source.

- Its rows are exactly the classes that list `SupportsEagle3` among their bases in
  vllm/model_executor/models/ (an AST scan, no model imports): a class vLLM adds is a missing row.
- Each row's wrapper path is read back from vLLM's source: every class of the row's chain (or a
  base it inherits `__init__` from) assigns the next attribute of the path, the last one the
  layer list and, after it, a final norm (attribute name and norm class as written there). A
  module tree with those names must resolve to the row's path. Seconds, no vLLM engine.
- docs/architectures.md is generated from the rows (its prose included).
- The capture's read of a class's own aux code (eagle3/capture/hooks.py) on a toy inner model whose layers
  return (full state, stale residual) as Cohere2Moe's do: what is stored, what the caller gets back, the
  aux settings restored, and a forward that does not return the states asked for refused.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest
import torch
from torch import nn

from eagle3.capture.architectures import ROWS, Row, markdown
from eagle3.capture.layers import NORM_NAMES, resolve_decoder_stack

REPO = Path(__file__).resolve().parents[2]


@functools.cache
def _models_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.skip("vllm is not installed")
    return Path(spec.origin).parent / "model_executor" / "models"


@functools.cache
def _module(name: str) -> ast.Module:
    return ast.parse((_models_dir() / f"{name}.py").read_text())


def _class(module: str, name: str) -> tuple[str, ast.ClassDef]:
    """(module, ClassDef) for `name` as seen from `module`: defined there, or imported from a sibling module."""
    tree = _module(module)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return module, node
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and any(a.name == name for a in node.names):
            sibling = node.module if node.level == 1 else node.module.removeprefix("vllm.model_executor.models.")
            if "." not in sibling:
                return _class(sibling, name)
    raise LookupError(f"class {name} not found from vllm/model_executor/models/{module}.py")


def _assigning_class(ref: str, attr: str) -> list[tuple[str, str]]:
    """The source-ordered assignments of the class in `ref`'s hierarchy whose __init__ assigns `self.<attr>`."""
    module, name = ref.split(":")
    todo = [(module, name)]
    while todo:
        mod, cls = _class(*todo.pop(0))
        lines = _assign_lines(cls)
        if any(a == attr for a, _ in lines):
            return lines
        todo += [(mod, ast.unparse(b).split(".")[-1]) for b in cls.bases if isinstance(b, (ast.Name, ast.Attribute))]
    raise AssertionError(f"{ref}: no class in its hierarchy assigns self.{attr} in __init__ (vLLM's source changed?)")


def _assign_lines(cls: ast.ClassDef) -> list[tuple[str, str]]:
    """(attribute, callee) for each `self.<attr> = <callee>(...)` in the class's own __init__, in line order
    (so "registered after the list" means what the source says); a `self._helper(...)` call of a method of
    the class counts as that method's assignments at the call's line (MiniCPM builds its layers so)."""
    methods = {fn.name: fn for fn in cls.body if isinstance(fn, ast.FunctionDef)}

    def collect(fn: ast.FunctionDef, order: tuple[int, ...], depth: int) -> list[tuple[tuple[int, ...], str, str]]:
        found = []
        for stmt in ast.walk(fn):
            if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                callee = ast.unparse(stmt.value.func).split(".")[-1] if isinstance(stmt.value, ast.Call) else ""
                for target in targets:
                    for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                            found.append(((*order, stmt.lineno), t.attr, callee))
            elif isinstance(stmt, ast.Call) and depth < 2 and isinstance(stmt.func, ast.Attribute):
                if isinstance(stmt.func.value, ast.Name) and stmt.func.value.id == "self" and stmt.func.attr in methods:
                    found += collect(methods[stmt.func.attr], (*order, stmt.lineno), depth + 1)
        return found

    init = methods.get("__init__")
    return [(attr, callee) for _, attr, callee in sorted(collect(init, (), 0) if init else [])]


def _norm_after(lines: list[tuple[str, str]], attr: str) -> tuple[str, str] | None:
    """The final norm (attribute, class) the source assigns after `self.<attr>`, else one named like a final norm."""
    real = [(a, c) for a, c in lines if c != "PPMissingLayer"]
    after = real[[a for a, _ in real].index(attr) + 1:]
    found = next(((a, c) for a, c in after if a in NORM_NAMES or "Norm" in c), None)
    return found or next(((a, c) for a, c in real if a in NORM_NAMES), None)


def _leaf(cls: str) -> nn.Module:
    return type(cls, (nn.Module,), {})()


def source_tree(row: Row) -> nn.Module:
    """A module tree with the class and attribute names vLLM's source gives `row`'s chain (4 layers)."""
    segments = row.path.split(".")
    assert len(segments) == len(row.chain), f"{row.cls}: path {row.path} and chain {row.chain} differ in length"
    nodes = [_leaf(ref.split(":")[1]) for ref in row.chain]
    owner_lines = _assigning_class(row.chain[-1], segments[-1])
    for i, ref in enumerate(row.chain[:-1]):
        _assigning_class(ref, segments[i])  # raises unless the source assigns it
    norm = _norm_after(owner_lines, segments[-1])
    norm_on = len(nodes) - 1
    if norm is None:  # a thin container (Plamo3Decoder): the norm follows the container on its parent
        norm, norm_on = _norm_after(_assigning_class(row.chain[-2], segments[-2]), segments[-2]), len(nodes) - 2
    assert norm is not None, f"{row.cls}: no final norm found in {row.chain[-1]}'s source"
    layers = nn.ModuleList(_leaf("DecoderLayer") for _ in range(4))
    for attr, _ in owner_lines:  # register the list and the norm in the source's order
        if attr == segments[-1]:
            setattr(nodes[-1], attr, layers)
        elif attr == norm[0] and norm_on == len(nodes) - 1 and not hasattr(nodes[-1], attr):
            setattr(nodes[-1], attr, _leaf(norm[1] or "Norm"))
    for i in range(len(nodes) - 2, -1, -1):
        setattr(nodes[i], segments[i], nodes[i + 1])
        if i == norm_on:
            setattr(nodes[i], norm[0], _leaf(norm[1] or "Norm"))
    if segments[0] == "language_model":  # a vision tower of the same depth: the resolver must not pick it
        tower = _leaf("VisionTower")
        tower.blocks, tower.post_layernorm = nn.ModuleList(_leaf("VisionBlock") for _ in range(4)), nn.LayerNorm(2)
        nodes[0].visual = tower
    return nodes[0]


def vllm_eagle3_classes() -> set[tuple[str, str]]:
    """(class, module) of every class in vLLM's models whose bases name SupportsEagle3."""
    found = set()
    for path in sorted(_models_dir().glob("*.py")):
        for node in ast.walk(_module(path.stem)):
            if isinstance(node, ast.ClassDef) and any(ast.unparse(b).split(".")[-1] == "SupportsEagle3" for b in node.bases):
                found.add((node.name, path.stem))
    return found


def test_the_rows_are_vllms_supports_eagle3_classes():
    rows = {(r.cls, r.module) for r in ROWS}
    vllm = vllm_eagle3_classes()
    assert len(rows) == len(ROWS), "a class has two rows"
    assert not vllm - rows, f"vLLM classes with SupportsEagle3 and no row in eagle3/capture/architectures.py: {sorted(vllm - rows)}"
    assert not rows - vllm, f"rows for classes vLLM does not mark SupportsEagle3: {sorted(rows - vllm)}"


@pytest.mark.parametrize("row", ROWS, ids=[r.cls for r in ROWS])
def test_the_resolver_finds_the_rows_path_on_a_tree_named_from_vllms_source(row: Row):
    stack = resolve_decoder_stack(source_tree(row))
    assert stack.path == row.path and stack.num_layers == 4


@pytest.mark.parametrize("row", ROWS, ids=[r.cls for r in ROWS])
def test_each_rows_evidence_names_a_test_that_exists(row: Row):
    for test_id in (row.evidence, row.served, row.aux):
        if "::" not in test_id:
            continue
        path, _, name = test_id.split(" ")[0].partition("::")
        assert f"def {name.split('[')[0]}(" in (REPO / path).read_text(), f"{row.cls}: {test_id} names no test"


@pytest.mark.parametrize("row", ROWS, ids=[r.cls for r in ROWS])
def test_the_draft_column_is_mla_exactly_for_the_classes_whose_vllm_modules_build_mla_attention(row: Row):
    """'auto' picks the MLA draft for a config with kv_lora_rank (eagle3/draft/architecture.py): the rows whose chain's
    vLLM modules read kv_lora_rank say deepseek_mla, every other row llama."""
    modules = {ref.split(":")[0] for ref in row.chain}
    reads_kv_lora = any("kv_lora_rank" in (_models_dir() / f"{m}.py").read_text() for m in modules)
    assert row.draft == ("deepseek_mla" if reads_kv_lora else "llama"), (row.cls, sorted(modules))


def test_docs_table_is_generated_from_the_rows():
    assert (REPO / "docs" / "architectures.md").read_text() == markdown(), (
        "docs/architectures.md is stale: run `python -m eagle3.capture.architectures > docs/architectures.md`")


# -- the capture's read of a class's own aux code (eagle3/capture/hooks.py), on a toy module: no engine --------------
class _StaleResidualLayer(nn.Module):
    """Cohere2Moe's convention: returns (full state, the stale residual it got)."""

    def __init__(self, step: float) -> None:
        super().__init__()
        self.step = step

    def forward(self, positions, hidden, residual):  # noqa: ANN001, ANN201
        return hidden + self.step, hidden


class _ToyModel(nn.Module):
    """An inner model with vLLM's aux code as Cohere2Moe writes it: after layer i, append the first value alone."""

    aux_hidden_state_layers: tuple[int, ...] = ()

    def __init__(self, answers_aux: bool = True) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_StaleResidualLayer(float(k)) for k in (1, 2, 3, 4))
        self.norm = nn.LayerNorm(2)
        self.answers_aux = answers_aux

    def forward(self, input_ids, positions):  # noqa: ANN001, ANN201
        hidden, residual, aux = input_ids.float()[:, None].repeat(1, 2), None, []  # [T, 2]
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(positions, hidden, residual)
            if i + 1 in self.aux_hidden_state_layers:
                aux.append(hidden)
        return (hidden, aux) if aux and self.answers_aux else hidden


def _toy_capture(inner: nn.Module, ids: list[int], **kw: bool):  # noqa: ANN202 - (states, capture, forward's output)
    from eagle3.capture.hooks import HiddenStateCapture

    root = nn.Module()
    root.model = inner
    capture = HiddenStateCapture(resolve_decoder_stack(root), ids, **kw)
    capture.install()
    try:
        with capture.collecting([[5, 6, 7]], hidden_size=2) as states:
            out = inner(torch.tensor([5, 6, 7]), torch.arange(3))
        return states[0], capture, out
    finally:
        capture.remove()


def test_the_capture_stores_what_the_classs_own_aux_code_returns_and_leaves_its_settings_as_they_were():
    tokens = torch.tensor([5.0, 6.0, 7.0])[:, None, None]
    state, capture, out = _toy_capture(_ToyModel(), [1, 4])
    assert capture.reads == "vllm-aux" and isinstance(out, torch.Tensor)  # the caller gets what it would have
    assert torch.equal(state, (tokens + torch.tensor([1.0, 10.0])[None, :, None]).expand(3, 2, 2))  # full states
    summed, capture, _ = _toy_capture(_ToyModel(), [1, 4], from_vllm_aux=False)  # the layer-hook rule: full + stale
    assert capture.reads == "layer-hooks"
    assert torch.equal(summed, (2 * tokens + torch.tensor([1.0, 16.0])[None, :, None]).expand(3, 2, 2))
    served = _ToyModel()
    served.aux_hidden_state_layers = (2,)  # a speculator's ids, set before: handed back, and still set after
    _, _, out = _toy_capture(served, [1, 4])
    assert isinstance(out, tuple) and len(out[1]) == 1 and torch.equal(out[1][0][:, 0], torch.tensor([8.0, 9.0, 10.0]))
    assert served.aux_hidden_state_layers == (2,) and _ToyModel().aux_hidden_state_layers == ()


def test_a_forward_that_does_not_return_the_aux_states_asked_for_is_an_error():
    from eagle3.capture.hooks import CaptureError

    inner = _ToyModel(answers_aux=False)
    with pytest.raises(CaptureError, match=r"_ToyModel.forward, asked for the aux hidden states of ids \[1, 4\], returned a Tensor"):
        _toy_capture(inner, [1, 4])
    assert "aux_hidden_state_layers" not in vars(inner)  # the class default again
