"""A cached result file that is not eagle3's JSON StageRecord is deleted unread, never unpickled."""

from __future__ import annotations

import base64
import json
import os
import pickle
from pathlib import Path

from prefect import flow, task

from eagle3.artifacts import StageRecord, building, mark_complete
from eagle3.stages import out_dir
from tasks.cache import RESULTS, cached, trusted_result

CALLS: list[str] = []


@task(name="toy_stage")
def toy_stage(root: Path, fp: str) -> StageRecord:
    CALLS.append(fp)
    final = out_dir(root, "toy_stage", fp)
    if final.exists():
        return StageRecord(stage="toy_stage", uri=str(final), fingerprint=fp)
    with building(final) as tmp:
        (tmp / "data.txt").write_text("x")
        return mark_complete(tmp, StageRecord(stage="toy_stage", uri=str(final), fingerprint=fp))


@flow
def toy_flow(root: Path, fp: str) -> str:
    state = cached(toy_stage, root, "toy_stage", fp)(root=root, fp=fp, return_state=True)
    return state.name


class _Payload:
    def __reduce__(self):  # noqa: ANN204 - what a tampered result file would carry
        return (os.system, (f"touch {Path.cwd() / 'payload-ran'}",))


def test_a_result_rewritten_to_pickle_is_deleted_and_never_run(prefect_harness, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "artifacts"
    assert toy_flow(root, "fp1") == "Completed"
    assert toy_flow(root, "fp1") == "Cached" and CALLS == ["fp1"]
    result = root / RESULTS / "toy_stage-fp1"
    assert trusted_result(result)
    record = json.loads(result.read_text())
    record["metadata"]["serializer"] = {"type": "pickle", "picklelib": "pickle"}
    record["result"] = base64.b64encode(pickle.dumps(_Payload())).decode()
    result.write_text(json.dumps(record))
    assert not trusted_result(result)
    assert toy_flow(root, "fp1") == "Completed"  # ran again (the artifact was whole: no work) instead of unpickling
    assert not (tmp_path / "payload-ran").exists()
    assert trusted_result(result) and CALLS == ["fp1", "fp1"]


def test_only_a_plain_stage_record_is_trusted(tmp_path):
    good = {"metadata": {"serializer": {"type": "json", "jsonlib": "json",
                                        "object_decoder": "prefect.serializers.prefect_json_object_decoder"}},
            "result": json.dumps({"__class__": "eagle3.artifacts.StageRecord", "data": {"stage": "x"}})}
    nested = good | {"result": json.dumps({"__class__": "eagle3.artifacts.StageRecord",
                                           "data": {"stats": {"__class__": "subprocess.Popen", "data": ["id"]}}})}
    other = good | {"result": json.dumps({"__class__": "builtins.dict", "data": {}})}
    for name, record, trusted in (("good", good, True), ("nested", nested, False), ("other", other, False)):
        (tmp_path / name).write_text(json.dumps(record))
        assert trusted_result(tmp_path / name) is trusted, name
    (tmp_path / "garbage").write_bytes(b"\x80\x04not json")
    assert not trusted_result(tmp_path / "garbage")
