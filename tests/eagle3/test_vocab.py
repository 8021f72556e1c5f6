"""The draft vocabulary mapping: what vLLM and speculators will read from d2t/t2d."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import save_file

from eagle3.draft.vocab import (
    VocabConfig,
    VocabError,
    build_mapping,
    count_tokens,
    load_mapping,
    save_mapping,
)


def _random_samples(seed: int, num: int = 20, vocab: int = 300) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(num):
        length = int(torch.randint(5, 50, (1,), generator=generator))
        # Skewed ids, like real text: small ids are much more frequent.
        ids = (torch.rand(length, generator=generator) ** 3 * vocab).long()
        mask = torch.rand(length, generator=generator) > 0.3
        samples.append((ids, mask))
    return samples


def test_every_draft_id_maps_to_a_target_id_that_t2d_marks():
    counts = count_tokens(_random_samples(0), 300)
    mapping = build_mapping(counts, 64)
    targets = torch.arange(64) + mapping.d2t  # what vLLM computes: i + d2t[i]
    assert mapping.d2t.dtype == torch.int64 and mapping.t2d.dtype == torch.bool
    assert targets.min() >= 0 and targets.max() < 300
    assert bool(mapping.t2d[targets].all())
    assert int(mapping.t2d.sum()) == 64
    assert torch.equal(targets, torch.nonzero(mapping.t2d).flatten())  # draft ids in target-id order


def test_the_most_frequent_tokens_win_and_ties_go_to_the_lower_id():
    counts = torch.tensor([5, 0, 7, 3, 7, 3, 1, 0])
    mapping = build_mapping(counts, 4)
    # 7 (ids 2, 4), 5 (id 0), then a tie at 3 between ids 3 and 5: the lower id, 3, wins.
    assert mapping.target_ids.tolist() == [0, 2, 3, 4]
    assert mapping.d2t.tolist() == [0, 1, 1, 1]
    assert mapping.t2d.tolist() == [True, False, True, True, True, False, False, False]


def test_same_data_gives_the_same_mapping_whatever_the_sample_order():
    samples = _random_samples(1)
    first = build_mapping(count_tokens(samples, 300), 50)
    second = build_mapping(count_tokens(list(reversed(samples)), 300), 50)
    assert torch.equal(first.d2t, second.d2t) and torch.equal(first.t2d, second.t2d)


def test_tokens_outside_the_loss_mask_are_not_counted():
    ids = torch.tensor([7, 7, 7, 7, 2, 3])
    mask = torch.tensor([False, False, False, False, True, True])
    counts = count_tokens([(ids, mask)], 10)
    assert counts[7] == 0 and counts[2] == 1 and counts[3] == 1
    assert build_mapping(counts, 2).target_ids.tolist() == [2, 3]


def test_a_draft_vocab_larger_than_the_target_vocab_is_refused_naming_the_setting():
    with pytest.raises(VocabError, match="vocab.draft_vocab_size"):
        build_mapping(torch.ones(10, dtype=torch.int64), 11)
    with pytest.raises(ValidationError):
        VocabConfig(draft_vocab_size=0)


def test_a_token_id_outside_the_vocabulary_is_an_error():
    with pytest.raises(VocabError, match="outside the target vocabulary"):
        count_tokens([(torch.tensor([1, 12]), torch.tensor([True, True]))], 10)


def test_save_and_load_round_trip(tmp_path):
    mapping = build_mapping(count_tokens(_random_samples(2), 300), 32)
    save_mapping(mapping, tmp_path / "vocab.safetensors")
    loaded = load_mapping(tmp_path / "vocab.safetensors")
    assert torch.equal(loaded.d2t, mapping.d2t) and torch.equal(loaded.t2d, mapping.t2d)
    assert [p.name for p in tmp_path.iterdir()] == ["vocab.safetensors"]  # no temp file left


def test_a_file_whose_d2t_and_t2d_disagree_is_refused(tmp_path):
    mapping = build_mapping(count_tokens(_random_samples(3), 300), 32)
    t2d = mapping.t2d.clone()
    t2d[int(torch.nonzero(~t2d)[0])] = True  # one extra target id without a draft id
    save_file({"d2t": mapping.d2t, "t2d": t2d}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(VocabError, match="disagree"):
        load_mapping(tmp_path / "bad.safetensors")
