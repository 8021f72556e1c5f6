"""A tiny real world for the draft-side tests: target folder, hidden-state stores, head, vocab.


Built once per test process (about 2 s) into a temporary folder: a random 8-layer Llama
(hidden 64, 4 heads of 32, 2 kv heads, vocab 512) whose own greedy answers are the data, the
way the `regenerate` stage makes it. Tests that change files copy what they change.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eagle3.capture.store import Sample, StoreWriter
from eagle3.draft.target_head import extract_target_head, load_target_head, read_target_config
from eagle3.draft.vocab import build_mapping, count_tokens, save_mapping
from tests.on_device import ON_CUDA, TINY_TRAIN_ON_DEVICE

NUM_LAYERS = 8
HIDDEN = 64
VOCAB = 512
AUX_LAYER_IDS = [2, NUM_LAYERS // 2, NUM_LAYERS - 3]
PROMPT_LEN = 8
ANSWER_LEN = 32
DRAFT_VOCAB = 256
# a small Llama-style draft shape (eagle3.draft.model.DraftConfig keyword arguments) for tests that build drafts by hand
SMALL_DRAFT = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                   rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                   max_position_embeddings=256, num_aux_hidden_states=3, target_vocab_size=512, draft_vocab_size=256)


@dataclass(frozen=True)
class TinyWorld:
    root: Path
    target_dir: Path
    train_store: Path
    heldout_store: Path
    head_path: Path
    vocab_path: Path


# vLLM's CPU attention wants >= 32. On CUDA 64, the smallest head a served model has: vLLM 0.25's model runner V2
# fails to capture the EAGLE-3 speculator's full CUDA graph at head_dim 32 on an H100 (cudaErrorInvalidAddressSpace;
# the V1 runner and piecewise graphs load it), while targets with 64 serve with vLLM's defaults
TINY_HEAD_DIM = 64 if ON_CUDA else 32


def tiny_llama_config(tie: bool = False) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=TINY_HEAD_DIM,  # not hidden/heads: checks that head_dim is carried
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
    )


def make_target(out_dir: Path, *, seed: int = 0, tie: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(tie)).eval()
    with torch.no_grad():  # a peaked next-token distribution, as a trained model has
        model.lm_head.weight.normal_(0.0, 0.5)
    model.save_pretrained(out_dir)
    return model


def greedy_samples(model: LlamaForCausalLM, num: int, seed: int) -> list[Sample]:
    """Random prompts, the target's greedy answers, and the aux + final (pre-norm) states."""
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, VOCAB, (num, PROMPT_LEN), generator=generator)  # [num, P]
    with torch.no_grad():
        ids = model.generate(
            prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=ANSWER_LEN,
            min_new_tokens=ANSWER_LEN, do_sample=False, pad_token_id=0,
        )  # [num, P + A]
        captured: list[torch.Tensor] = []
        hook = model.model.layers[-1].register_forward_hook(
            lambda _m, _i, out: captured.append(out[0] if isinstance(out, tuple) else out)
        )
        out = model(ids, output_hidden_states=True)
        hook.remove()
    final = captured[0]  # [num, T, H], before the final norm (vLLM's layer id N)
    aux = torch.stack([out.hidden_states[k] for k in AUX_LAYER_IDS], dim=2)  # [num, T, n_aux, H]
    states = torch.cat([aux, final[:, :, None]], dim=2)  # [num, T, n_aux+1, H]
    mask = torch.zeros(ids.shape, dtype=torch.bool)
    mask[:, PROMPT_LEN:] = True
    return [
        Sample(sample_id=f"s{seed}-{i}", input_ids=ids[i], loss_mask=mask[i], hidden_states=states[i].contiguous())
        for i in range(num)
    ]


def write_store(root: Path, samples: list[Sample], per_shard: int = 10) -> Path:
    groups = [samples[i : i + per_shard] for i in range(0, len(samples), per_shard)]
    writer = StoreWriter(
        root, aux_layer_ids=AUX_LAYER_IDS, hidden_size=HIDDEN, dtype=torch.float32,
        expected_shards=[[s.sample_id for s in g] for g in groups],
    )
    for index, group in enumerate(groups):
        writer.write_shard(index, group)
    return root


@functools.cache
def tiny_world() -> TinyWorld:
    root = Path(tempfile.mkdtemp(prefix="eagle3-draft-tests-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    target_dir = root / "target"
    model = make_target(target_dir)
    train = greedy_samples(model, 40, seed=1)
    heldout = greedy_samples(model, 12, seed=2)
    world = TinyWorld(
        root=root,
        target_dir=target_dir,
        train_store=write_store(root / "store-train", train),
        heldout_store=write_store(root / "store-heldout", heldout),
        head_path=root / "target_head.safetensors",
        vocab_path=root / "vocab.safetensors",
    )
    extract_target_head(target_dir, world.head_path)
    counts = count_tokens(((s.input_ids, s.loss_mask) for s in train), VOCAB)
    save_mapping(build_mapping(counts, DRAFT_VOCAB), world.vocab_path)
    return world


def tiny_head():
    world = tiny_world()
    return load_target_head(world.head_path, read_target_config(world.target_dir))


@contextlib.contextmanager
def single_thread():
    """One intra-op thread: these tensors are tiny, and a second thread only adds contention
    (with another process busy on the second core, a 200x128 matmul took 15 ms instead of 0.1)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def one_thread():
    """single_thread() around each test that imports this fixture."""
    with single_thread():
        yield


TRAIN_KW = dict(learning_rate=3e-3, warmup_steps=5, batch_tokens=200, ttt_steps=3, **TINY_TRAIN_ON_DEVICE)


@functools.cache
def trained_run():
    """A 60-step training run on the tiny world (about 2 s), shared by the tests that need one."""
    from eagle3.train.trainer import TrainConfig, train_draft

    world = tiny_world()
    out = world.root / "trained"
    config = TrainConfig(steps=60, checkpoint_every=30, **TRAIN_KW)
    with single_thread():
        return train_draft(
            config, store_dir=world.train_store, target_dir=world.target_dir, head_path=world.head_path,
            vocab_path=world.vocab_path, out_dir=out,
        )


@functools.cache
def trained_and_exported(draft, name: str) -> tuple[Path, Path]:  # noqa: ANN001 - eagle3.draft.architecture.DraftSettings
    """(checkpoint, export dir) of a 40-step draft with train.draft `draft` on the tiny world (one thread), under
    `name`; shared by the tests of one draft setting."""
    from eagle3.draft.export import export_draft
    from eagle3.train.trainer import TrainConfig, train_draft

    world = tiny_world()
    with single_thread():
        result = train_draft(TrainConfig(steps=40, checkpoint_every=40, draft=draft, **TRAIN_KW),
                             store_dir=world.train_store, target_dir=world.target_dir, head_path=world.head_path,
                             vocab_path=world.vocab_path, out_dir=world.root / f"trained-{name}")
    export = export_draft(result.checkpoint, world.root / f"export-{name}", target_dir=world.target_dir,
                          aux_layer_ids=AUX_LAYER_IDS, vocab_path=world.vocab_path)
    return result.checkpoint, export
