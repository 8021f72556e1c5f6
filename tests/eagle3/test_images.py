"""Conversations with images (issue 28, item 3), the data side, no engine: OpenAI-style content parts are read and
rendered through the chat template, image placeholders are never learned, image files are content-hashed into the
fingerprints, and bad input (a missing image, an unsupported part, an image for a text-only target) is one DataError
naming the sample id and the part, raised by the fingerprint (before any load), with nothing written."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from eagle3 import stages
from eagle3.capture.extract import ExtractInputError, check_inputs, expand_sample
from eagle3.capture.regenerate import RegenerateConfig
from eagle3.data.conversations import DataConfig, DataError, TokenizedSample, load_conversations, read_samples
from eagle3.data.images import placeholder_id, reads_images
from eagle3.data.target import TargetConfig
from tests.eagle3.image_data import build_kimi_with_images, image_row, write_png, write_rows

NO_REGEN = RegenerateConfig(enabled=False)


@pytest.fixture(scope="module")
def kimi(tmp_path_factory, builtin_cache):  # noqa: ANN001, ANN201
    """(target config, stage_target record, artifact root) of the tiny Kimi-K2.5 with its vision tower."""
    model = build_kimi_with_images(tmp_path_factory.mktemp("targets") / "kimi")
    root = tmp_path_factory.mktemp("artifacts")
    config = TargetConfig(model=str(model), max_model_len=512, dtype="float32", keep_warm_s=0, aux_layer_ids=[1, 2, 3])
    return config, stages.run_stage_target(config, builtin_cache, root, stages.fingerprint_target(config)), root


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, builtin_cache):  # noqa: ANN001, ANN201
    root = tmp_path_factory.mktemp("artifacts-tiny")
    config = TargetConfig(model="builtin:tiny", max_model_len=256, dtype="float32")
    return config, stages.run_stage_target(config, builtin_cache, root, stages.fingerprint_target(config)), root


def _fp(staged, data: DataConfig) -> str:  # noqa: ANN001
    config, target, _ = staged
    return stages.fingerprint_regenerate(NO_REGEN, data, target, config.max_model_len)


def _prepare(staged, data: DataConfig):  # noqa: ANN001, ANN202
    config, target, root = staged
    regen = stages.run_regenerate(NO_REGEN, data, config, target, root, _fp(staged, data), root / "loads.jsonl")
    return stages.run_prepare(data, regen, target, False, root, stages.fingerprint_prepare(data, regen, target))


def test_the_kimi_target_reads_images_and_names_its_placeholder(kimi, tiny):
    assert reads_images(kimi[1].stats["model_dir"]) and not reads_images(tiny[1].stats["model_dir"])
    tokenizer = AutoTokenizer.from_pretrained(kimi[1].stats["model_dir"])
    assert placeholder_id(kimi[1].stats["model_dir"]) == tokenizer.convert_tokens_to_ids("<|media_pad|>")


def test_image_parts_are_rendered_as_the_placeholder_and_never_learned(kimi, tmp_path):
    png = write_png(tmp_path / "a.png", seed=1)
    inline = "data:image/png;base64," + base64.b64encode(write_png(tmp_path / "b.png", seed=2).read_bytes()).decode()
    source = write_rows(tmp_path / "chats.jsonl", [image_row("file", png), image_row("inline", inline, answer="A dog.")])
    data = DataConfig(source=str(source), heldout_fraction=0.0)
    prepared = _prepare(kimi, data)
    samples = {s.id: s for s in read_samples(prepared.path / "train.jsonl")}
    tokenizer = AutoTokenizer.from_pretrained(kimi[1].stats["model_dir"])
    pad = tokenizer.convert_tokens_to_ids("<|media_pad|>")
    for cid, url, answer in (("file", f"file://{png}", "A cat."), ("inline", inline, "A dog.")):
        sample = samples[cid]
        assert sample.images == (url,)
        assert sample.input_ids.count(pad) == 1
        assert all(m == 0 for t, m in zip(sample.input_ids, sample.loss_mask) if t == pad)
        learned = tokenizer.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if m])
        assert learned.startswith(answer)
    # the regenerate artifact keeps the parts as given (prepare_data reads them back)
    assert load_conversations(data)[0].messages[0].content[0].url == f"file://{png}"


def test_a_changed_image_changes_the_fingerprints_even_at_the_same_path(kimi, tmp_path):
    png = write_png(tmp_path / "a.png", seed=1)
    data = DataConfig(source=str(write_rows(tmp_path / "chats.jsonl", [image_row("c0", png)])))
    before = _fp(kimi, data)
    assert _fp(kimi, data) == before
    write_png(png, seed=7)
    assert _fp(kimi, data) != before


def test_text_only_data_keeps_its_fingerprint_and_samples(kimi, tmp_path):
    """No content parts: the same fingerprint as data written before images existed (the settings hold no images)."""
    rows = [{"id": "t0", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}]
    data = DataConfig(source=str(write_rows(tmp_path / "chats.jsonl", rows)))
    config, target, _ = kimi
    from eagle3.fingerprint import hash_files

    settings = {"regenerate": NO_REGEN.model_dump(mode="json", exclude={"endpoint", "api_key_env"}),
                "source": data.source, "max_samples": data.max_samples}
    assert _fp(kimi, data) == stages.stage_fingerprint("regenerate", settings, hash_files([Path(data.source)]))
    sample = read_samples(_prepare(kimi, data).path / "train.jsonl")[0]
    assert sample.images == ()


def _refused(staged, rows: list[dict], tmp_path: Path, *expected: str) -> None:  # noqa: ANN001
    data = DataConfig(source=str(write_rows(tmp_path / "chats.jsonl", rows)))
    before = sorted(staged[2].rglob("*"))
    with pytest.raises(DataError) as err:
        _fp(staged, data)  # the fingerprint is asked for before the stage runs: nothing is loaded or written
    message = str(err.value)
    assert len(message.splitlines()) == 1
    for text in expected:
        assert text in message
    assert sorted(staged[2].rglob("*")) == before


def test_a_missing_image_file_is_one_error_naming_the_sample_and_part(kimi, tmp_path):
    ok = write_png(tmp_path / "ok.png", seed=3)
    _refused(kimi, [image_row("fine", ok), image_row("lost", tmp_path / "gone.png")], tmp_path,
             "sample 'lost'", "message 0 (user), content part 0", "gone.png", "does not exist")


def test_an_unsupported_content_part_is_one_error_naming_the_sample_and_part(kimi, tmp_path):
    row = {"id": "audio", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Listen"}, {"type": "input_audio", "input_audio": {}}]},
        {"role": "assistant", "content": "Nice."}]}
    _refused(kimi, [row], tmp_path, "sample 'audio'", "content part 1", "'input_audio' is not supported")


def test_an_image_for_a_text_only_target_is_one_error_before_any_load(tiny, tmp_path):
    png = write_png(tmp_path / "a.png", seed=4)
    _refused(tiny, [image_row("pic", png)], tmp_path, "sample 'pic'", "content part 0", "text-only")
    assert not (tiny[2] / "loads.jsonl").exists()  # nothing loaded


def test_a_file_that_is_not_an_image_is_refused(kimi, tmp_path):
    fake = tmp_path / "fake.png"
    fake.write_text("not a picture")
    _refused(kimi, [image_row("fake", fake)], tmp_path, "sample 'fake'", "does not decode as an image")


def test_expansion_masks_the_positions_it_adds_and_keeps_the_others():
    sample = TokenizedSample("s", [5, 9, 7, 1, 2], [0, 0, 0, 1, 1], images=("file:///x.png",))
    out = expand_sample(sample, [5, 9, 9, 9, 7, 1, 2])
    assert out.input_ids == [5, 9, 9, 9, 7, 1, 2] and out.loss_mask == [0, 0, 0, 0, 0, 1, 1]
    assert out.images == sample.images
    with pytest.raises(ExtractInputError, match="sample 's'"):
        expand_sample(sample, [5, 9, 9, 1, 2])


def test_a_sample_with_images_is_never_truncated():
    sample = TokenizedSample("s", list(range(20)), [1] * 20, images=("file:///x.png",))
    with pytest.raises(ExtractInputError, match="hold images: never truncated"):
        check_inputs([sample], [1], 4, 10, "truncate")
    json.dumps(sample.images)


def test_images_through_an_engine_elsewhere_are_refused_before_any_load(kimi, tmp_path):
    config, target, root = kimi
    data = DataConfig(source=str(write_rows(tmp_path / "chats.jsonl", [image_row("pic", write_png(tmp_path / "a.png", 5))])),
                      heldout_fraction=0.0)
    loads = tmp_path / "loads.jsonl"
    regen = RegenerateConfig(endpoint="http://127.0.0.1:9")
    with pytest.raises(DataError, match=r"regenerate: the data holds images.*regenerate.endpoint='http://127.0.0.1:9'"):
        stages.run_regenerate(regen, data, config, target, root, fp := stages.fingerprint_regenerate(regen, data, target, 512), loads)
    assert not stages.out_dir(root, "regenerate", fp).exists()  # nothing written
    prepared = _prepare(kimi, data)
    from eagle3.capture.extract import ExtractConfig

    hf = ExtractConfig(backend="hf")
    with pytest.raises(DataError, match=r"extract: the data holds images.*extract.backend='hf'"):
        stages.run_extract(hf, config, prepared, target, root, stages.fingerprint_extract(hf, config, prepared, target), loads)
    assert not stages.out_dir(root, "extract", stages.fingerprint_extract(hf, config, prepared, target)).exists()
    assert not loads.exists()


def test_a_template_that_does_not_render_image_parts_is_refused_naming_the_sample(kimi, tmp_path):
    from eagle3.data.conversations import Conversation, Message
    from eagle3.data.images import Part
    from eagle3.data.conversations import tokenize_turns

    tokenizer = AutoTokenizer.from_pretrained(kimi[1].stats["model_dir"])
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: text{% endfor %}"  # drops every image
    conv = Conversation("dropped", (Message("user", (Part("image_url", url="file:///x.png"), Part("text", text="hi"))),
                                    Message("assistant", "ok")))
    with pytest.raises(DataError, match=r"sample 'dropped': the chat template rendered 0 image placeholder tokens"):
        tokenize_turns(tokenizer, conv, 512, placeholder=placeholder_id(kimi[1].stats["model_dir"]))
    with pytest.raises(DataError, match=r"sample 'dropped' holds images, but the target's config.json names no image"):
        tokenize_turns(tokenizer, conv, 512, placeholder=None)


def test_a_list_that_is_not_content_parts_makes_a_bad_row(tmp_path):
    from eagle3.data.conversations import scan_jsonl

    good = image_row("good", "file:///x.png")
    bad = [{"id": f"b{i}", "messages": [{"role": "user", "content": [part]}, {"role": "assistant", "content": "ok"}]}
           for i, part in enumerate([{"type": 5}, {"type": "text"}, {"type": "image_url", "image_url": "file:///x.png"}])]
    conversations, skipped = scan_jsonl(write_rows(tmp_path / "chats.jsonl", [good, *bad]), 10, 10)
    assert [c.id for c in conversations] == ["good"]
    assert [(b.line, b.reason) for b in skipped] == [
        (2, "message 0: content part 0 is not an object with a string 'type'"),
        (3, "message 0: content part 0 (text) has no string 'text'"),
        (4, "message 0: content part 0 (image_url) has no 'image_url': {'url': str}")]
