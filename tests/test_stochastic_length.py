"""Stochastic length: long training histories are cut to N^(alpha/2) tokens with probability
1 - N^alpha / n^2, deterministically under the seed, targets and labels following the kept
tokens; on in training only."""

import pytest
import torch
from torchrec import KeyedJaggedTensor

from gr.data.stochastic_length import keep_whole_probability, kept_length, stochastic_length_index, subsample_histories
from gr.model import GRInput
from gr.train import module as training_module
from gr.train import train
from gr.train.config import TrainConfig
from helpers.runs import recipe


def batch(lengths, num_targets=None):
    """A jagged batch whose item id, timestamp, query time, dense feature and next-item label of token t
    all equal t."""
    lengths = torch.tensor(lengths)
    total = int(lengths.sum())
    tokens = torch.arange(total)
    ids = KeyedJaggedTensor.from_lengths_sync(["item_id"], tokens, lengths)
    labels = {"next_item": tokens.clone()} if num_targets is None else {"click": torch.arange(int(sum(num_targets)))}
    return GRInput(
        seq_offsets=torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
        max_seq_len=int(lengths.max()),
        timestamps=tokens.clone(),
        query_times=tokens.clone(),
        num_targets=None if num_targets is None else torch.tensor(num_targets),
        sequence_ids=ids,
        token_dense={"age": tokens.float().unsqueeze(1)},
        labels=labels,
    )


def test_keep_whole_probability_follows_the_paper():
    n = torch.tensor([1, 63, 64, 100, 200, 1000])
    expected = torch.tensor([1.0, 1.0, 1000**1.2 / 64**2, 1000**1.2 / 100**2, 1000**1.2 / 200**2, 1000**1.2 / 1000**2])
    assert kept_length(1000, 1.2) == 63  # 1000^0.6 = 63.1
    assert torch.allclose(keep_whole_probability(n, 1000, 1.2), expected.double())
    assert (keep_whole_probability(n, 1000, 2.0) == 1).all()  # alpha 2: dense, nothing cut


def test_long_histories_are_cut_at_the_papers_rate():
    """1000 sequences of 100 tokens, N = 200, alpha = 1.5: cut to 200^0.75 = 53 tokens with
    probability 1 - 200^1.5 / 100^2 = 0.717; binomial sd 0.014, tolerance 4 sd."""
    offsets = torch.arange(1001) * 100
    generator = torch.Generator().manual_seed(0)
    index, lengths = stochastic_length_index(offsets, None, 200, 1.5, generator)
    assert set(lengths.tolist()) == {53, 100}
    assert (lengths == 53).float().mean().item() == pytest.approx(1 - 200**1.5 / 100**2, abs=0.056)
    assert index.numel() == int(lengths.sum())


def test_cut_batch_keeps_tokens_in_order_with_their_features_and_labels():
    original = batch([3, 12, 10])
    cut = subsample_histories(original, 12, 1.2, torch.Generator().manual_seed(1))  # 12^0.6 = 4.4 -> 4
    assert cut.seq_offsets.tolist() == [0, 3, 7, 11] and cut.max_seq_len == 4
    kept = cut.sequence_ids["item_id"].values()
    assert torch.equal(cut.timestamps, kept) and torch.equal(cut.labels["next_item"], kept)
    assert torch.equal(cut.query_times, kept)
    assert torch.equal(cut.token_dense["age"].squeeze(1).long(), kept)
    assert kept[:3].tolist() == [0, 1, 2]  # the short history is whole
    for start, end, lo, hi in ((3, 7, 3, 15), (7, 11, 15, 25)):
        seq = kept[start:end]
        assert (seq.diff() > 0).all() and seq.min() >= lo and seq.max() < hi  # in order, own sequence


def test_targets_are_always_kept_and_their_labels_untouched():
    original = batch([14, 9], num_targets=[2, 1])
    cut = subsample_histories(original, 12, 1.2, torch.Generator().manual_seed(0))
    kept = cut.sequence_ids["item_id"].values()
    assert cut.seq_offsets.tolist() == [0, 6, 11]  # 4 history + 2 targets, 4 history + 1 target
    assert kept[4:6].tolist() == [12, 13] and kept[10].item() == 22
    assert torch.equal(cut.labels["click"], original.labels["click"])


def test_same_seed_same_cut_other_seed_other_cut():
    offsets = torch.arange(9) * 40
    runs = [stochastic_length_index(offsets, None, 40, 1.2, torch.Generator().manual_seed(s))[0] for s in (3, 3, 4)]
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])


@pytest.mark.parametrize("alpha", [1.0, 2.5, "yes"])
def test_alpha_is_validated_when_the_config_is_read(alpha):
    with pytest.raises(ValueError, match=r"trainer.stochastic_length_alpha: expected null or a number in \(1.0, 2.0\]"):
        recipe(("trainer.stochastic_length_alpha", alpha))


def test_training_cuts_histories_and_evaluation_does_not(tmp_path, monkeypatch):
    """Off by default; on, every training step goes through it and no evaluation step does."""
    assert TrainConfig.from_dict(recipe()).trainer.stochastic_length_alpha is None
    lengths = {"train": [], "eval": []}
    cut = training_module.subsample_histories

    def recording_cut(batch, max_len, alpha, generator):
        out = cut(batch, max_len, alpha, generator)
        lengths["train"].append((batch.seq_offsets[-1].item(), out.seq_offsets[-1].item()))
        return out

    evaluate = training_module.GRTrainingModule.validation_step

    def recording_evaluate(self, batch, batch_idx):
        lengths["eval"].append(batch.seq_offsets.diff().max().item())
        return evaluate(self, batch, batch_idx)

    monkeypatch.setattr(training_module, "subsample_histories", recording_cut)
    monkeypatch.setattr(training_module.GRTrainingModule, "validation_step", recording_evaluate)
    config = recipe(("trainer.max_epochs", 1), ("trainer.stochastic_length_alpha", 1.2))  # 20^0.6 -> 6 tokens
    train(TrainConfig.from_dict(config), tmp_path)
    assert len(lengths["train"]) == 5  # every training step
    assert all(after < before for before, after in lengths["train"])
    assert lengths["eval"] and max(lengths["eval"]) > kept_length(20, 1.2)
