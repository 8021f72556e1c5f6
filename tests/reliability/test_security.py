"""Security: remote code only when configured, nothing unpickled from an artifact, no path out of the
artifact root from data or a hand-edited file, servers on 127.0.0.1."""

from __future__ import annotations

import ast
import hashlib
import inspect
import json
import os
from pathlib import Path

import pytest
import torch

from eagle3.capture import vllm_adapter
from eagle3.capture.store import MANIFEST, StoreError, StoreReader, StoreWriter
from eagle3.data.target import TargetConfig
from eagle3.draft.checkpoint import STATE, CheckpointError, load_checkpoint, save_checkpoint
from tests.reliability import faults

ROOT = Path(__file__).resolve().parents[2]
CODE = sorted(p for d in ("eagle3", "tasks", "flows", "deployments") for p in (ROOT / d).rglob("*.py"))


def _calls(name: str):  # noqa: ANN202 - (file, ast.Call) for every call of a function or method `name`
    for path in CODE:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                if called == name:
                    yield path.relative_to(ROOT), node


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def test_remote_code_is_off_unless_the_target_config_turns_it_on():
    assert TargetConfig().trust_remote_code is False
    loads = [(f, c) for name in ("from_pretrained", "LLM") for f, c in _calls(name)]
    assert len(loads) >= 4  # tokenizer, HF model, vLLM engines, the GGUF conversion
    for file, call in loads:  # omitted: transformers and vLLM default to False
        value = _keyword(call, "trust_remote_code")
        assert value is None or not isinstance(value, ast.Constant), f"{file}:{call.lineno}: trust_remote_code hard-coded"


def test_nothing_is_unpickled():
    for path in CODE:
        tree = ast.parse(path.read_text())
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                    for a in (n.names if isinstance(n, ast.Import) else [ast.alias(n.module or "")])}
        assert not imported & {"pickle", "cloudpickle", "dill", "joblib", "shelve", "marshal"}, path
    for file, call in _calls("load"):
        if isinstance(call.func, ast.Attribute) and getattr(call.func.value, "id", None) == "torch":
            flag = _keyword(call, "weights_only")
            assert isinstance(flag, ast.Constant) and flag.value is True, f"{file}:{call.lineno}: torch.load without weights_only=True"
        assert not isinstance(_keyword(call, "allow_pickle"), ast.Constant) or not _keyword(call, "allow_pickle").value, file
    serializers = [(f, _keyword(c, "result_serializer")) for f, c in _calls("with_options")]
    assert serializers and all(isinstance(v, ast.Constant) and v.value == "json" for f, v in serializers if v is not None)


class _Payload:
    def __reduce__(self):  # noqa: ANN204 - what a malicious state.pt would carry
        return (os.system, ("touch payload-ran",))


def test_a_checkpoint_holding_a_pickled_object_is_refused_not_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = save_checkpoint(tmp_path / "ckpt", 3, {"w": torch.zeros(2)}, {"data": {"epoch": 0}}, {})
    torch.save({"data": _Payload()}, path / STATE)  # replaced by a pickle that runs code, with a matching checksum
    meta = json.loads((path / "meta.json").read_text())
    blob = (path / STATE).read_bytes()
    meta["files"][STATE] = {"size": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="cannot be loaded"):
        load_checkpoint(path)
    assert not (tmp_path / "payload-ran").exists()


def test_a_hand_edited_manifest_or_checkpoint_cannot_reach_outside(tmp_path):
    victim = tmp_path / "victim.safetensors"
    victim.write_bytes(b"precious")
    store = tmp_path / "a" / "store"
    samples = faults._samples(0)
    writer = StoreWriter(store, aux_layer_ids=faults.AUX, hidden_size=faults.H, dtype=torch.float32,
                         expected_shards=[[s.sample_id for s in samples]])
    writer.write_shard(0, samples)
    manifest = json.loads((store / MANIFEST).read_text())
    manifest["shards"][0]["file"] = "../../victim.safetensors"
    (store / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match=r"shard file '\.\./\.\./victim\.safetensors' is not a shard name inside the store"):
        StoreReader(store)
    assert victim.read_bytes() == b"precious"
    path = save_checkpoint(tmp_path / "ckpt", 3, {"w": torch.zeros(2)}, {"data": {"epoch": 0}}, {})
    meta = json.loads((path / "meta.json").read_text())
    meta["files"]["../../victim.safetensors"] = {"size": 8, "sha256": hashlib.sha256(b"precious").hexdigest()}
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="lists files"):
        load_checkpoint(path)


def test_sample_ids_never_become_paths(builtin_cache, tmp_path):
    """Ids that look like paths go through prepare_data and extract; every file stays under the artifact root."""
    source = tmp_path / "chats.jsonl"
    ids = ["../../escape", "/tmp/absolute-id", "..", "a/b/c", "shard-00000.safetensors"] + [f"ok-{i}" for i in range(11)]
    source.write_text("".join(json.dumps({"id": i, "messages": [{"role": "user", "content": f"hi {n}"},
                                                                 {"role": "assistant", "content": f"hello {n}"}]}) + "\n"
                              for n, i in enumerate(ids)))
    root = tmp_path / "deep" / "artifacts"
    before = set(tmp_path.rglob("*")) | set(Path("/tmp").glob("absolute-id*"))
    try:
        world = faults.World(root, builtin_cache, source=str(source))
    finally:
        vllm_adapter.release_all()
    after = set(tmp_path.rglob("*")) | set(Path("/tmp").glob("absolute-id*"))
    assert {p for p in after - before if root not in p.parents and p != root and p not in root.parents} == set()
    stored = {i for split in ("train", "heldout") for e in StoreReader(world.extracted.path / split).shards for i in e.sample_ids}
    assert stored == set(ids)


def test_every_server_the_project_starts_binds_loopback():
    from flows import cli, deploy

    assert inspect.signature(deploy.serve).parameters["host"].default == "127.0.0.1"
    serve_options = {a.dest for a in cli._parser()._subparsers._group_actions[0].choices["serve"]._actions}
    assert "host" not in serve_options  # `eagle3 serve` has no way to ask for another address
    starts = [(f, c) for f, c in _calls("Popen") if any(isinstance(e, ast.Constant) and e.value == "server"
                                                        for e in getattr(c.args[0], "elts", []))]
    assert starts, "no `prefect server start` found"
    for file, call in starts:
        args = [getattr(e, "value", getattr(e, "id", None)) for e in call.args[0].elts]
        assert "--host" in args and args[args.index("--host") + 1] == "host", f"{file}:{call.lineno}: no --host"
    for path in CODE + [ROOT / "deployments" / "prefect.yaml"]:
        assert "0.0.0.0" not in path.read_text(), path


def test_a_registry_draft_id_cannot_name_a_path():
    from pydantic import ValidationError

    from eagle3.ops.publish import PublishedDraft

    fields = {"acceptance_length": 1.5, "heldout_samples": 1, "train_samples": 1, "train_tokens": 1,
              "export_fingerprint": "f", "code_version": "v", "created_at": "t"}
    assert PublishedDraft(draft_id="0123abcd0123abcd", **fields).draft_id == "0123abcd0123abcd"
    for bad in ("../../../tmp/x", "/abs", "a/b", ".."):
        with pytest.raises(ValidationError, match="draft_id"):
            PublishedDraft(draft_id=bad, **fields)
