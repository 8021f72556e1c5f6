"""Training the draft: the loss falls, checkpoints are whole, resume continues the same run."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file

from eagle3.capture.store import StoreReader
from eagle3.draft.batches import next_batch_indices
from eagle3.draft.checkpoint import list_checkpoints, load_checkpoint
from eagle3.train.trainer import TrainConfig, TrainError, lr_at, train_draft
from tests.eagle3.draft_fixtures import TRAIN_KW, one_thread, tiny_world, trained_run  # noqa: F401


def _train(out_dir, stop_after=None, progress=None, heldout_store_dir=None, **overrides):
    world = tiny_world()
    config = TrainConfig(**(dict(steps=12, checkpoint_every=4, **TRAIN_KW) | overrides))
    return train_draft(config, store_dir=world.train_store, target_dir=world.target_dir,
                       head_path=world.head_path, vocab_path=world.vocab_path, out_dir=out_dir,
                       stop_after=stop_after, progress=progress, heldout_store_dir=heldout_store_dir)


def _final_weights(result) -> dict[str, torch.Tensor]:
    return load_file(str(result.checkpoint / "model.safetensors"))


def test_sixty_steps_make_the_loss_fall():
    """The loss falls, and the result says how long training took. How fast is benchmarks/train_throughput.py's
    figure, not a bound here: a wall-clock bound fails on a loaded 2-core machine."""
    result = trained_run()
    assert result.steps_done == 60 and len(result.losses) == 60
    first, last = sum(result.losses[:5]) / 5, sum(result.losses[-5:]) / 5
    assert last < 0.3 * first, (first, last)
    assert result.seconds > 0
    assert result.tokens_seen > 60 * 100 and result.resumed_from_step is None
    assert result.checkpoint.name == "step-000060"


def test_losses_jsonl_has_every_step_with_per_ttt_step_losses_and_lr():
    result = trained_run()
    entries = [json.loads(line) for line in (result.checkpoint.parent.parent / "losses.jsonl").read_text().splitlines()]
    assert [e["step"] for e in entries] == list(range(1, 61))
    assert all(len(e["loss_per_ttt_step"]) == 3 for e in entries)
    assert [e["loss"] for e in entries] == pytest.approx(result.losses)
    assert entries[0]["lr"] == pytest.approx(lr_at(0, TrainConfig(steps=60, **TRAIN_KW)))


def test_interrupted_and_resumed_equals_uninterrupted(tmp_path):
    straight = _train(tmp_path / "straight")
    stopped = _train(tmp_path / "resumed", stop_after=6)  # killed after step 6: last checkpoint is step 4
    assert stopped.steps_done == 6 and stopped.checkpoint.name == "step-000004"
    reported = []
    resumed = _train(tmp_path / "resumed", progress=lambda *args: reported.append(args))
    assert resumed.resumed_from_step == 4 and resumed.steps_done == 12
    assert [(step, total) for step, total, _ in reported] == [(s, 12) for s in range(5, 13)]
    assert [loss for _, _, loss in reported] == pytest.approx(straight.losses[4:], abs=1e-6)
    assert resumed.losses == pytest.approx(straight.losses, abs=1e-6)
    for name, tensor in _final_weights(straight).items():
        torch.testing.assert_close(_final_weights(resumed)[name], tensor, rtol=0, atol=1e-6)
    assert resumed.tokens_seen == straight.tokens_seen


def test_a_truncated_latest_checkpoint_is_skipped_with_a_warning(tmp_path, caplog):
    straight = _train(tmp_path / "straight")
    _train(tmp_path / "run", stop_after=8)  # checkpoints 4 and 8
    newest = tmp_path / "run" / "checkpoints" / "step-000008" / "model.safetensors"
    newest.write_bytes(newest.read_bytes()[:100])  # a crash that cut the file
    with open(tmp_path / "run" / "losses.jsonl", "a") as log_file:
        log_file.write('{"step": 9, "lo')  # ... and the loss log in the middle of a line
    with caplog.at_level(logging.WARNING, logger="eagle3.draft.checkpoint"):
        resumed = _train(tmp_path / "run")
    assert "step-000008" in caplog.text
    assert resumed.resumed_from_step == 4
    assert resumed.losses == pytest.approx(straight.losses, abs=1e-6)
    for name, tensor in _final_weights(straight).items():
        torch.testing.assert_close(_final_weights(resumed)[name], tensor, rtol=0, atol=1e-6)


def test_what_a_kill_mid_write_leaves_is_gone_once_the_run_resumes(tmp_path):
    """A SIGKILL can land inside any write: a checkpoint folder being written, a pruned one being deleted (renamed to
    a dot name first), or the rewrite of losses.jsonl / evals.jsonl (atomic_write_text's temporary). Planted as such
    a kill leaves them, they are gone after the resumed run, which ends as one never stopped."""
    straight = _train(tmp_path / "straight")
    out = tmp_path / "run"
    _train(out, stop_after=8)
    leftovers = [out / "checkpoints" / ".step-000012.tmp-999999", out / "checkpoints" / ".step-000004.old-999999"]
    for folder in leftovers:
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"half")
    leftovers += [out / ".losses.jsonl.tmp-999999-1", out / ".evals.jsonl.tmp-999999-1"]
    for path in leftovers[2:]:
        path.write_text('{"step": 9, "lo')
    resumed = _train(out)
    assert resumed.resumed_from_step == 8 and resumed.losses == pytest.approx(straight.losses, abs=1e-6)
    assert [p.name for p in leftovers if p.exists()] == []
    assert not [p.name for p in [*out.iterdir(), *(out / "checkpoints").iterdir()] if p.name.startswith(".")]


def test_only_the_last_two_checkpoints_are_kept_and_they_load_weights_only(tmp_path):
    result = _train(tmp_path / "run")
    names = [p.name for p in list_checkpoints(tmp_path / "run" / "checkpoints")]
    assert names == ["step-000008", "step-000012"]
    assert not [p for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.startswith(".")]
    state = torch.load(result.checkpoint / "state.pt", weights_only=True)  # plain tensors, no pickled objects
    assert isinstance(state["rng"]["cpu"], torch.Tensor)
    assert state["data"]["epoch"] >= 0 and state["scheduler"]["last_step"] == 12
    assert load_checkpoint(result.checkpoint).step == 12


def test_a_finished_run_is_not_trained_again(tmp_path):
    first = _train(tmp_path / "run")
    again = _train(tmp_path / "run")
    assert again.resumed_from_step == 12 and again.steps_done == 12
    assert again.losses == first.losses and again.checkpoint == first.checkpoint


def test_resuming_with_other_settings_names_them(tmp_path):
    _train(tmp_path / "run", stop_after=4)
    with pytest.raises(TrainError, match="train.learning_rate"):
        _train(tmp_path / "run", learning_rate=1e-2)


def test_warmup_then_cosine_decay_to_the_floor():
    config = TrainConfig(steps=100, learning_rate=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, config) == pytest.approx(0.1) and lr_at(9, config) == pytest.approx(1.0)
    assert lr_at(55, config) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(100, config) == pytest.approx(0.1)
    with pytest.raises(ValidationError, match="warmup_steps"):
        TrainConfig(steps=10, warmup_steps=10)


def test_every_epoch_visits_every_sample_once_in_a_seeded_order():
    lengths = [int(StoreReader(tiny_world().train_store)[i].num_tokens) for i in range(5)] * 8  # 40 samples
    def one_epoch(seed):
        seen, epoch, cursor = [], 0, 0
        while (epoch, cursor) != (0, 40):
            batch, epoch, cursor = next_batch_indices(lengths, seed, epoch, cursor, 200)
            assert sum(min(lengths[i], 200) for i in batch) <= 200 or len(batch) == 1
            seen += batch
        return seen
    assert sorted(one_epoch(0)) == list(range(40))
    assert one_epoch(0) == one_epoch(0) and one_epoch(0) != one_epoch(1)


def test_every_checkpoint_is_scored_on_held_out_data_and_the_best_survives_pruning(tmp_path):
    world = tiny_world()
    result = _train(tmp_path / "run", heldout_store_dir=world.heldout_store)
    evals = [json.loads(line) for line in (tmp_path / "run" / "evals.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [4, 8, 12] and result.evals == evals
    assert all(e["acceptance_length"] >= 1.0 and len(e["per_position"]) == 3 for e in evals)
    best = max(reversed(evals), key=lambda e: e["acceptance_length"])
    assert result.best_checkpoint == tmp_path / "run" / "checkpoints" / best["checkpoint"]
    assert result.best_checkpoint.is_dir() and load_checkpoint(result.best_checkpoint).step == best["step"]


def test_a_best_checkpoint_older_than_the_last_two_is_kept(tmp_path):
    from eagle3.draft.checkpoint import save_checkpoint

    root = tmp_path / "checkpoints"
    weights = {"w": torch.zeros(2)}
    for step in (1, 2, 3, 4):
        save_checkpoint(root, step, weights, {"step": step}, {}, keep=2, protect={"step-000001"})
    assert [p.name for p in list_checkpoints(root)] == ["step-000001", "step-000003", "step-000004"]


def test_best_eval_prefers_the_later_checkpoint_on_a_tie():
    from eagle3.train.trainer import best_eval

    evals = [{"step": 4, "acceptance_length": 1.5}, {"step": 8, "acceptance_length": 1.7},
             {"step": 12, "acceptance_length": 1.7}, {"step": 16, "acceptance_length": 1.6}]
    assert best_eval(evals)["step"] == 12 and best_eval([]) is None


def test_the_best_checkpoint_is_the_best_walk_not_the_best_score_at_every_position():
    from eagle3.train.trainer import best_eval

    evals = [{"step": 4, "acceptance_length": 1.9, "walk": 1.6}, {"step": 8, "acceptance_length": 1.8, "walk": 1.7},
             {"step": 12, "acceptance_length": 1.7, "walk": 1.5}]
    assert best_eval(evals)["step"] == 8


def test_select_last_exports_the_last_checkpoint_though_every_one_is_scored(tmp_path):
    world = tiny_world()
    result = _train(tmp_path / "run", heldout_store_dir=world.heldout_store, select="last")
    assert [e["step"] for e in result.evals] == [4, 8, 12] and all("walk" in e for e in result.evals)
    assert result.best_checkpoint == result.checkpoint == tmp_path / "run" / "checkpoints" / "step-000012"


def test_resume_keeps_the_held_out_scores_and_scores_what_is_missing(tmp_path):
    world = tiny_world()
    straight = _train(tmp_path / "straight", heldout_store_dir=world.heldout_store)
    _train(tmp_path / "run", stop_after=9, heldout_store_dir=world.heldout_store)  # checkpoints 4 and 8 scored
    evals = tmp_path / "run" / "evals.jsonl"
    evals.write_text(evals.read_text().splitlines()[0] + "\n")  # killed before step 8 was scored
    resumed = _train(tmp_path / "run", heldout_store_dir=world.heldout_store)
    assert resumed.resumed_from_step == 8
    assert [e["step"] for e in resumed.evals] == [4, 8, 12]
    for ours, theirs in zip(resumed.evals, straight.evals, strict=True):
        assert ours["acceptance_length"] == pytest.approx(theirs["acceptance_length"], abs=1e-9)


def test_fused_and_plain_kl_equal_the_definition_with_gradients():
    from eagle3.train.loss import fused_kl_loss, kl_loss, plain_kl_loss

    generator = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(7, 50, generator=generator)).requires_grad_(True)
    target_logp = torch.log_softmax(3 * torch.randn(7, 50, generator=generator), dim=-1)
    weights = torch.tensor([1.0, 0, 1, 1, 0, 1, 1])
    reference = kl_loss(logits, target_logp, weights)
    probs = target_logp.exp()
    fused = fused_kl_loss(logits, probs, (probs * target_logp).sum(-1), weights)
    torch.testing.assert_close(fused, reference, rtol=1e-6, atol=1e-7)
    (want,) = torch.autograd.grad(reference, logits)
    (got,) = torch.autograd.grad(fused, logits)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    plain = plain_kl_loss(logits, probs, (probs * target_logp).sum(-1), weights)  # what train.compile compiles
    torch.testing.assert_close(plain, reference, rtol=1e-6, atol=1e-7)
    (got,) = torch.autograd.grad(plain, logits)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_compiled_training_follows_eager_training(tmp_path):
    """train.compile (on by default on CUDA) compiles the TTT step and the loss kernels. Here on the CPU's
    compiler: the same losses and weights up to rounding, with the step and the loss kernels compiled.

    Two TTT steps, not the default three: each TTT step is a graph of its own (it attends to one more set of keys)
    and each took 15-21 s to compile on a 2-core CPU; two show that a later step's graph follows eager as well as
    the first's (the test took 58 s on a 2-core EPYC against 75 s with three)."""
    from torch._dynamo.utils import counters

    eager = _train(tmp_path / "eager", steps=6, checkpoint_every=6, grad_accum=2, compile=False, ttt_steps=2)
    counters.clear()
    compiled = _train(tmp_path / "compiled", steps=6, checkpoint_every=6, grad_accum=2, compile=True, ttt_steps=2)
    assert compiled.losses == pytest.approx(eager.losses, rel=1e-4)
    for name, tensor in _final_weights(eager).items():
        torch.testing.assert_close(_final_weights(compiled)[name], tensor, rtol=1e-4, atol=1e-5)
    assert counters["stats"]["unique_graphs"] >= 2 + 2  # the step at TTT steps 0 and 1; target and KL kernels


def test_a_compiler_that_fails_names_the_setting_to_train_eagerly(tmp_path, monkeypatch):
    """A node whose torch.compile cannot build kernels (no Triton, no C++ compiler) fails on the first step
    with the setting to change, and writes no checkpoint."""
    import functools

    def broken_backend(graph, example_inputs):
        raise RuntimeError("no C++ compiler on this node")

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=broken_backend))
    with pytest.raises(TrainError, match=r"train\.compile=false") as failure:
        _train(tmp_path / "run", steps=6, checkpoint_every=2, compile=True)
    assert "no C++ compiler on this node" in str(failure.value)
    assert not list_checkpoints(tmp_path / "run" / "checkpoints")


def test_batch_loss_reads_each_rows_target_where_ttt_alignment_says(tmp_path):
    """The loss reads row r's target at r+1+j as a slice; it equals the explicit gather of
    ttt_alignment's target positions, on a batch of several packed samples."""
    from eagle3.draft.batches import pack
    from eagle3.train.loss import batch_loss, kl_loss
    from eagle3.draft.model import DraftConfig, Eagle3Draft, init_draft, ttt_alignment
    from eagle3.draft.target_head import read_target_config, target_logits
    from eagle3.draft.vocab import load_mapping
    from tests.eagle3.draft_fixtures import tiny_head

    world, head = tiny_world(), tiny_head()
    mapping = load_mapping(world.vocab_path)
    model = Eagle3Draft(DraftConfig.from_target(read_target_config(world.target_dir), num_aux_hidden_states=3,
                                                draft_vocab_size=mapping.draft_vocab_size))
    init_draft(model, head, mapping, seed=3)
    samples = [StoreReader(world.train_store)[i] for i in (0, 1, 2)]
    batch = pack(samples, steps=3, max_tokens=30)  # cut to 30 tokens each: some rows lose their target
    draft_head = type(head)(head.embed, head.norm_weight, head.norm_eps, head.lm_head[mapping.target_ids])
    with torch.no_grad():
        total, per_step = batch_loss(model, batch, draft_head)
        aux, final = batch.split_states(torch.float32)
        target_logp = torch.log_softmax(target_logits(draft_head, final), dim=-1)
        rows = torch.cat([ttt_alignment(s.input_ids[:30], s.loss_mask[:30], 3)[1] + 30 * d for d, s in enumerate(samples)], 1)
        drafts = list(model.unroll(aux, batch.step_tokens, batch.positions, batch.doc_ids, head.embed))
    for step in range(3):
        want = kl_loss(drafts[step], target_logp[rows[step]], batch.weights[step])
        torch.testing.assert_close(per_step[step], want, rtol=1e-5, atol=1e-6)


def test_padded_cpu_batches_give_the_loss_and_gradients_of_the_batch():
    """The CPU trainer pads each micro-batch to a multiple of 128 rows (few matmul shapes, so oneDNN reuses its
    kernels): on a batch of three packed samples and on a single sample (plain causal attention), the loss, the
    per-step losses and every gradient equal the unpadded batch's."""
    from eagle3.draft.batches import pack, pad_rows
    from eagle3.draft.model import DraftConfig, Eagle3Draft, init_draft
    from eagle3.draft.target_head import read_target_config
    from eagle3.draft.vocab import load_mapping
    from eagle3.train.loss import batch_loss
    from tests.eagle3.draft_fixtures import tiny_head

    world, head = tiny_world(), tiny_head()
    mapping = load_mapping(world.vocab_path)
    model = Eagle3Draft(DraftConfig.from_target(read_target_config(world.target_dir), num_aux_hidden_states=3,
                                                draft_vocab_size=mapping.draft_vocab_size))
    init_draft(model, head, mapping, seed=3)
    draft_head = type(head)(head.embed, head.norm_weight, head.norm_eps, head.lm_head[mapping.target_ids])
    store = StoreReader(world.train_store)

    def loss_and_grads(batch, one_doc):  # noqa: ANN001, ANN202
        model.zero_grad(set_to_none=True)
        total, per_step = batch_loss(model, batch, draft_head, one_doc)
        total.backward()
        return total.detach(), torch.stack(per_step).detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    for indices in ((0, 1, 2), (3,)):
        batch = pack([store[i] for i in indices], steps=3, max_tokens=64)
        padded = pad_rows(batch, 128)
        assert padded.num_tokens % 128 == 0 and padded.num_tokens > batch.num_tokens
        assert pad_rows(padded, 128) is padded  # already a multiple: the same batch
        assert pad_rows(batch, 128, limit=batch.num_tokens + 5).num_tokens == batch.num_tokens + 5  # never past the
        assert pad_rows(batch, 128, limit=batch.num_tokens - 1) is batch  # longest batch train.batch_tokens makes
        want, got = loss_and_grads(batch, len(indices) == 1), loss_and_grads(padded, len(indices) == 1)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
        assert want[2].keys() == got[2].keys()
        for name, grad in want[2].items():
            torch.testing.assert_close(got[2][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_ttt_loss_decay_weights_the_draft_positions_and_keeps_old_fingerprints_at_its_default():
    """train.ttt_loss_decay=0.5: the loss is (L0 + 0.5 L1 + 0.25 L2) / 1.75 of the same per-step losses (the first
    draft token counts most); at the default 1.0 it is their mean and the train fingerprint is the one from before
    the setting; another decay is another artifact; a decay outside (0, 1] is refused naming the setting."""
    from eagle3.artifacts import StageRecord
    from eagle3.draft.batches import pack
    from eagle3.train.loss import batch_loss
    from eagle3.draft.model import DraftConfig, Eagle3Draft, init_draft
    from eagle3.draft.target_head import read_target_config
    from eagle3.draft.vocab import load_mapping
    from eagle3.draft_stages import fingerprint_train
    from tests.eagle3.draft_fixtures import tiny_head

    world, head = tiny_world(), tiny_head()
    mapping = load_mapping(world.vocab_path)
    model = Eagle3Draft(DraftConfig.from_target(read_target_config(world.target_dir), num_aux_hidden_states=3,
                                                draft_vocab_size=mapping.draft_vocab_size))
    init_draft(model, head, mapping, seed=3)
    batch = pack([StoreReader(world.train_store)[i] for i in (0, 1)], steps=3, max_tokens=64)
    draft_head = type(head)(head.embed, head.norm_weight, head.norm_eps, head.lm_head[mapping.target_ids])
    with torch.no_grad():
        mean, per_step = batch_loss(model, batch, draft_head)
        weighted, same = batch_loss(model, batch, draft_head, decay=0.5)
    assert len({round(float(x), 6) for x in per_step}) == 3  # three different losses, so the weights matter
    torch.testing.assert_close(mean, torch.stack(per_step).mean())
    torch.testing.assert_close(weighted, (per_step[0] + 0.5 * per_step[1] + 0.25 * per_step[2]) / 1.75)
    torch.testing.assert_close(torch.stack(same), torch.stack(per_step))

    upstream = [StageRecord(stage=n, uri="/x", fingerprint=n) for n in ("extract", "vocab", "stage_target")]
    plain = fingerprint_train(TrainConfig(steps=10, warmup_steps=1), *upstream)
    assert plain == "c26cabe8f67fc68358c7"  # pinned before the setting existed (test_tokens_per_step)
    assert fingerprint_train(TrainConfig(steps=10, warmup_steps=1, ttt_loss_decay=0.8), *upstream) != plain
    for bad in (0.0, 1.5):
        with pytest.raises(ValidationError, match="ttt_loss_decay"):
            TrainConfig(ttt_loss_decay=bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_batches_read_straight_from_the_shards_equal_the_store_readers(tmp_path, dtype):
    from eagle3.capture.store import StoreWriter
    from eagle3.draft.batches import pack, read_batch

    world = tiny_world()
    source = StoreReader(world.train_store)
    samples = [source[i] for i in range(6)]
    writer = StoreWriter(tmp_path / "store", aux_layer_ids=source.aux_layer_ids, hidden_size=source.hidden_size,
                         dtype=dtype, expected_shards=[[s.sample_id for s in samples[:4]], [s.sample_id for s in samples[4:]]])
    writer.write_shard(0, samples[:4])
    writer.write_shard(1, samples[4:])
    reader = StoreReader(tmp_path / "store", dequantize_dtype=torch.float32)
    locations = [(str(reader.root / e.file), j) for e in reader.shards for j in range(len(e.sample_ids))]
    got = read_batch(locations, [5, 0, 2], steps=3, max_tokens=33, pin=False)
    want = pack([reader[5], reader[0], reader[2]], steps=3, max_tokens=33)
    assert got.states.dtype == dtype and got.num_tokens == 3 * 33
    for a, b in zip(got.split_states(torch.float32), want.split_states(torch.float32), strict=True):
        assert torch.equal(a, b)
    for name in ("step_tokens", "positions", "doc_ids", "weights"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


def test_compiling_does_not_change_the_train_fingerprint():
    """train.compile changes speed, not what is trained: cached train artifacts stay valid."""
    from eagle3.artifacts import StageRecord
    from eagle3.draft_stages import fingerprint_train

    ups = [StageRecord(stage=n, uri="/x", fingerprint=n) for n in ("extract", "vocab", "stage_target")]
    base = fingerprint_train(TrainConfig(steps=10, warmup_steps=1), *ups)
    assert fingerprint_train(TrainConfig(steps=10, warmup_steps=1, compile=True), *ups) == base
    assert fingerprint_train(TrainConfig(steps=10, warmup_steps=1, learning_rate=1e-3), *ups) != base


def test_muon_trains_the_hidden_matrices_and_resumes_as_if_never_stopped(tmp_path):
    """train.optimizer='muon': the loss falls, the run is not AdamW's, and a stopped run resumes to the same weights."""
    adamw = _train(tmp_path / "adamw")
    straight = _train(tmp_path / "straight", optimizer="muon")
    assert sum(straight.losses[-3:]) < 0.8 * sum(straight.losses[:3]), straight.losses
    assert straight.losses != pytest.approx(adamw.losses, abs=1e-4)
    _train(tmp_path / "resumed", stop_after=6, optimizer="muon")
    resumed = _train(tmp_path / "resumed", optimizer="muon")
    assert resumed.resumed_from_step == 4
    assert resumed.losses == pytest.approx(straight.losses, abs=1e-6)
    for name, tensor in _final_weights(straight).items():
        torch.testing.assert_close(_final_weights(resumed)[name], tensor, rtol=0, atol=1e-6)
    with pytest.raises(TrainError, match="train.optimizer"):  # its optimizer state is not AdamW's
        _train(tmp_path / "resumed", steps=16, optimizer="adamw")


def test_muon_takes_the_hidden_matrices_and_adamw_the_head_and_norms():
    from eagle3.draft.model import Eagle3Draft
    from eagle3.train.optim import build_optimizer

    world = tiny_world()
    config = json.loads((world.target_dir / "config.json").read_text())
    model = Eagle3Draft(_draft_config(world))
    names, params = zip(*model.named_parameters(), strict=True)
    optimizer = build_optimizer("muon", names, params, 1e-3, 0.0, fused=False)
    on_muon = {id(p) for group in optimizer.muon.param_groups for p in group["params"]}
    assert {n for n, p in zip(names, params, strict=True) if id(p) in on_muon} == {
        n for n, p in zip(names, params, strict=True) if p.ndim == 2 and "lm_head" not in n}
    assert any("fc" in n for n in names) and config["hidden_size"] > 1
    assert optimizer.muon.param_groups[0]["weight_decay"] == 0.1
    decays = {id(p): g["weight_decay"] for g in optimizer.adamw.param_groups for p in g["params"]}
    assert all(decays[id(p)] == 0.0 for n, p in zip(names, params, strict=True) if n.endswith("norm.weight"))
    with pytest.raises(ValueError, match="train.optimizer='sgd'"):
        build_optimizer("sgd", names, params, 1e-3, 0.0, fused=False)


def _draft_config(world):
    from eagle3.draft.model import DraftConfig
    from eagle3.draft.target_head import read_target_config
    from eagle3.draft.vocab import load_mapping

    mapping = load_mapping(world.vocab_path)
    return DraftConfig.from_target(read_target_config(world.target_dir), num_aux_hidden_states=3,
                                   draft_vocab_size=mapping.draft_vocab_size)


def test_the_optimizer_setting_at_its_default_keeps_the_fingerprints_of_drafts_trained_before_it(tmp_path):
    """Upgrading adds train.optimizer; drafts cached before it (AdamW) stay Cached and their checkpoints resume."""
    from eagle3.artifacts import StageRecord
    from eagle3.draft_stages import fingerprint_train

    ups = [StageRecord(stage=n, uri="/x", fingerprint=n) for n in ("extract", "vocab", "stage_target")]
    config = TrainConfig(steps=10, warmup_steps=1)
    assert fingerprint_train(config, *ups) == "c26cabe8f67fc68358c7"  # printed by b061aec, before train.optimizer
    assert fingerprint_train(TrainConfig(steps=10, warmup_steps=1, optimizer="muon"), *ups) != fingerprint_train(config, *ups)

    _train(tmp_path / "run", stop_after=6)
    meta_path = tmp_path / "run" / "checkpoints" / "step-000004" / "meta.json"
    meta = json.loads(meta_path.read_text())
    del meta["train_config"]["optimizer"]  # as written before the setting existed
    meta_path.write_text(json.dumps(meta))
    assert _train(tmp_path / "run").resumed_from_step == 4


def test_feature_noise_changes_what_is_learned_resumes_as_if_never_stopped_and_keeps_old_fingerprints(tmp_path):
    """train.feature_noise=0.3: the draft reads the target's states with noise of 0.3 of each state's RMS, so the
    run differs from a plain one; the noise is seeded by the step and micro-batch, so a stopped run resumes to the
    same losses and weights; at the default 0 the train fingerprint is the one from before the setting; a value
    outside [0, 1] is refused naming the setting."""
    from eagle3.artifacts import StageRecord
    from eagle3.train.loss import add_feature_noise
    from eagle3.draft_stages import fingerprint_train

    states = torch.randn(4000, 3, 64) * torch.tensor([0.5, 4.0, 40.0]).view(1, 3, 1)  # three very different scales
    noisy = add_feature_noise(states, 0.1, torch.Generator().manual_seed(0))
    rms = states.pow(2).mean(-1, keepdim=True).sqrt()
    relative = ((noisy - states) / rms).std(dim=(0, 2))
    torch.testing.assert_close(relative, torch.full((3,), 0.1), rtol=0.02, atol=0)

    plain = _train(tmp_path / "plain")
    straight = _train(tmp_path / "straight", feature_noise=0.3)
    assert straight.losses != pytest.approx(plain.losses, abs=1e-4)
    _train(tmp_path / "resumed", stop_after=6, feature_noise=0.3)
    resumed = _train(tmp_path / "resumed", feature_noise=0.3)
    assert resumed.resumed_from_step == 4
    assert resumed.losses == pytest.approx(straight.losses, abs=1e-6)
    for name, tensor in _final_weights(straight).items():
        torch.testing.assert_close(_final_weights(resumed)[name], tensor, rtol=0, atol=1e-6)

    upstream = [StageRecord(stage=n, uri="/x", fingerprint=n) for n in ("extract", "vocab", "stage_target")]
    assert fingerprint_train(TrainConfig(steps=10, warmup_steps=1), *upstream) == "c26cabe8f67fc68358c7"
    assert fingerprint_train(TrainConfig(steps=10, warmup_steps=1, feature_noise=0.1), *upstream) != "c26cabe8f67fc68358c7"
    for bad in (-0.1, 1.5):
        with pytest.raises(ValidationError, match="feature_noise"):
            TrainConfig(feature_noise=bad)
