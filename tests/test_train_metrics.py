"""Losses, metrics and the retrieval task's sampling, each against a naive implementation written here."""

import math

import pytest
import torch
import torch.nn.functional as F
from torchrec import KeyedJaggedTensor

from gr import GRInput, GROutput
from gr.ops import random as rng
from gr.ops.catalogue_rank import pytorch as catalogue_rank_pytorch
from gr.ops.native import native_ops
from gr.ops.sampled_softmax import cpu as sampled_softmax_cpu
from gr.ops.sampled_softmax import pytorch as sampled_softmax_pytorch
from gr.ops.sampled_softmax import sampled_softmax_loss
from gr.train.build import SAMPLED_ITEMS
from gr.train.config import RankingSection, RetrievalSection
from gr.train.losses import multitask_bce
from gr.train.metrics import (
    grouped_auc,
    per_user_metrics,
    ranking_metrics,
    retrieval_metrics,
    score_ranks,
    shared_score_ranks,
    target_metrics,
    target_ranks,
)
from gr.train.tasks import RankingTask, RetrievalTask
from helpers.native import X86, skip_without_bf16_instructions


def naive_rank(scores, target, excluded):
    t = scores[target]
    return sum(1 for i, s in enumerate(scores.tolist()) if i not in excluded and (s > t or (s == t and i < target)))


def test_target_rank_excludes_items_and_breaks_ties_by_id():
    torch.manual_seed(0)
    queries, items = torch.randn(7, 4), torch.randn(30, 4)
    items[5] = items[3]  # a tie
    targets = torch.tensor([3, 5, 0, 29, 11, 3, 17])
    excluded = [[1, 2, 5], [], [0, 4], list(range(10)), [11], [3, 5, 7], [16, 18]]
    offsets = torch.tensor([0] + [len(e) for e in excluded]).cumsum(0)
    flat = torch.tensor([i for e in excluded for i in e], dtype=torch.long)
    ranks = target_ranks(queries, items, targets, offsets, flat)
    expected = [naive_rank(queries[b] @ items.T, int(targets[b]), set(excluded[b])) for b in range(7)]
    assert ranks.tolist() == expected
    assert target_ranks(queries, items, targets, offsets, flat, distinct=True).tolist() == expected
    popularity = torch.tensor([float(i % 4) for i in range(30)]).expand(7, -1)
    expected_pop = [naive_rank(popularity[b], int(targets[b]), set(excluded[b])) for b in range(7)]
    assert score_ranks(popularity, targets, offsets, flat).tolist() == expected_pop


def test_ranks_of_a_shared_score_vector_and_of_a_score_matrix_follow_the_definition():
    """The popularity baseline's ranks from one sort, and a score matrix's: ties, an item excluded
    twice, a target among its own exclusions; non-finite scores as the matrix ranks them."""
    generator = torch.Generator().manual_seed(2)
    popularity = torch.randint(0, 5, (40,), generator=generator).float()
    targets = torch.randint(0, 40, (50,), generator=generator)
    lengths = torch.randint(0, 12, (50,), generator=generator)
    lengths[0] = 3
    flat = torch.randint(0, 40, (int(lengths.sum()),), generator=generator)
    flat[:2] = targets[0]  # row 0 excludes its own target, twice
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    excluded = [set(flat[offsets[b] : offsets[b + 1]].tolist()) for b in range(50)]
    expected = [naive_rank(popularity, int(targets[b]), excluded[b]) for b in range(50)]
    assert shared_score_ranks(popularity, targets, offsets, flat).tolist() == expected
    assert score_ranks(popularity.expand(50, -1), targets, offsets, flat).tolist() == expected
    popularity[7] = float("nan")
    expected = score_ranks(popularity.expand(50, -1), targets, offsets, flat)
    assert shared_score_ranks(popularity, targets, offsets, flat).tolist() == expected.tolist()


@pytest.mark.parametrize("fused", ["0", "auto"], ids=["pytorch", "fused-if-built"])
def test_target_rank_in_chunks_matches_one_pass(monkeypatch, fused):
    import gr.ops.catalogue_rank.pytorch as pytorch_ranks
    import gr.train.metrics as metrics

    monkeypatch.setenv("GR_CPU_FUSED", fused)
    torch.manual_seed(1)
    queries, items = torch.randn(9, 3), torch.randn(20, 3)
    targets = torch.randint(0, 20, (9,))
    offsets, flat = torch.tensor([0, 1, 1, 3] + [3] * 6), torch.tensor([4, 7, 7])
    whole = target_ranks(queries, items, targets, offsets, flat)
    monkeypatch.setattr(metrics, "SCORE_CHUNK_ELEMENTS", 40)  # two rows per chunk
    assert target_ranks(queries, items, targets, offsets, flat).tolist() == whole.tolist()
    monkeypatch.setattr(pytorch_ranks, "INT16_COLUMNS", 7)  # a row's items counted in three blocks
    assert target_ranks(queries, items, targets, offsets, flat).tolist() == whole.tolist()


def test_catalogue_and_shared_ranks_native_and_pytorch_count_alike_and_follow_the_definition():
    """Ties (also with the target), an item excluded twice, a target among its own exclusions,
    a chunk whose exclusions start inside the list: the C++ passes and the PyTorch ones agree with
    the definition, from a score matrix and from one shared score vector."""
    native = native_ops("gr_cpu_rank")
    if native is None:
        pytest.skip("gr's native kernels are not built on this machine")
    generator = torch.Generator().manual_seed(3)
    scores = torch.randint(0, 6, (40, 25), generator=generator).float()  # many ties
    targets = torch.randint(0, 25, (40,), generator=generator)
    lengths = torch.randint(0, 9, (40,), generator=generator)
    lengths[0] = 4
    flat = torch.randint(0, 25, (int(lengths.sum()) + 3,), generator=generator)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]) + 3  # the first 3 belong to no row
    flat[3:5] = targets[0]  # row 0 excludes its own target, twice
    excluded = [set(flat[offsets[b] : offsets[b + 1]].tolist()) for b in range(40)]
    expected = [naive_rank(scores[b], int(targets[b]), excluded[b]) for b in range(40)]
    assert native.catalogue_ranks(scores, targets, offsets, flat).tolist() == expected
    assert catalogue_rank_pytorch.catalogue_ranks(scores, targets, offsets, flat).tolist() == expected
    shared = scores[0]
    place = torch.empty(25, dtype=torch.long)
    place[torch.sort(shared, descending=True, stable=True).indices] = torch.arange(25)
    expected = [naive_rank(shared, int(targets[b]), excluded[b]) for b in range(40)]
    assert native.place_ranks(place, targets, offsets, flat).tolist() == expected
    assert catalogue_rank_pytorch.place_ranks(place, targets, offsets, flat).tolist() == expected
    with pytest.raises(RuntimeError, match="excluded item 25 outside"):
        native.catalogue_ranks(scores, targets, offsets, torch.where(flat == flat[3], 25, flat))


def test_retrieval_metrics_follow_their_definitions():
    ranks = torch.tensor([0, 3, 9, 10, 150])
    m = retrieval_metrics(ranks, (10, 200))
    assert m["hr@10"] == pytest.approx(3 / 5)
    assert m["hr@200"] == pytest.approx(1.0)
    assert m["ndcg@10"] == pytest.approx((1 + 1 / math.log2(5) + 1 / math.log2(11)) / 5)
    assert m["mrr"] == pytest.approx(sum(1 / (r + 1) for r in ranks.tolist()) / 5)


def test_per_user_metrics_average_each_users_targets_and_their_mean_is_the_reported_metric():
    ranks = torch.tensor([0, 50, 2, 50, 50, 9])
    users = torch.tensor([9, 7, 9, 7, 7, 3])
    ids, targets, means = per_user_metrics(target_metrics(ranks, (10,)), users)
    assert ids.tolist() == [3, 7, 9] and targets.tolist() == [1, 3, 2]
    assert means["hr@10"].tolist() == [1.0, 0.0, 1.0]
    assert means["mrr"].tolist() == pytest.approx([1 / 10, (3 / 51) / 3, (1 + 1 / 3) / 2])
    reported = retrieval_metrics(ranks, (10,), users)
    assert reported == pytest.approx({name: value.mean().item() for name, value in means.items()})
    assert reported["hr@10"] == pytest.approx(2 / 3)


def test_gauc_weights_each_users_auc_by_its_candidates_and_skips_one_class_users():
    torch.manual_seed(0)
    users = torch.tensor([5] * 6 + [2] * 4 + [9] * 3 + [7] * 5)
    logits = torch.randn(len(users)).round(decimals=0)  # ties within a user count half
    labels = torch.tensor([1, 0, 0, 1, 0, 1, 0, 1, 1, 0, 1, 1, 1, 0, 1, 0, 0, 0]).float()
    expected, weight = 0.0, 0
    for user in users.unique():
        mine = users == user
        if 0 < labels[mine].sum() < mine.sum():  # user 9 has only positives
            pos, neg = logits[mine][labels[mine] == 1], logits[mine][labels[mine] == 0]
            pairs = (pos[:, None] > neg[None, :]).float() + 0.5 * (pos[:, None] == neg[None, :]).float()
            expected, weight = expected + pairs.double().mean().item() * int(mine.sum()), weight + int(mine.sum())
    assert grouped_auc(logits, labels, users) == pytest.approx(expected / weight, abs=1e-12)
    m = ranking_metrics({"watch": logits}, {"watch": labels}, users)
    assert m["gauc/watch"] == m["gauc"] == pytest.approx(expected / weight, abs=1e-12)
    assert math.isnan(grouped_auc(logits[10:13], labels[10:13], users[10:13]))  # one user, one class
    assert "gauc" not in ranking_metrics({"watch": logits}, {"watch": labels})


def test_auc_and_logloss_per_task():
    torch.manual_seed(0)
    logits = {"watch": torch.randn(50), "like": torch.randn(50)}
    labels = {"watch": (torch.rand(50) > 0.5).float(), "like": (torch.rand(50) > 0.7).float()}
    m = ranking_metrics(logits, labels)
    for task in logits:
        pos, neg = logits[task][labels[task] == 1], logits[task][labels[task] == 0]
        pairs = (pos[:, None] > neg[None, :]).float() + 0.5 * (pos[:, None] == neg[None, :]).float()
        assert m[f"auc/{task}"] == pytest.approx(pairs.mean().item(), abs=1e-6)
        p = torch.sigmoid(logits[task])
        manual = -(labels[task] * p.log() + (1 - labels[task]) * (1 - p).log()).mean()
        assert m[f"logloss/{task}"] == pytest.approx(manual.item(), abs=1e-5)
    assert m["auc"] == pytest.approx((m["auc/watch"] + m["auc/like"]) / 2)
    assert math.isnan(ranking_metrics({"x": torch.randn(4)}, {"x": torch.ones(4)})["auc/x"])


def naive_sampled_softmax(queries, items, positive_index, negative_index, temperature):
    losses = []
    for n in range(queries.shape[0]):
        negs = negative_index[n] if negative_index.dim() == 2 else negative_index
        logits = [queries[n] @ items[positive_index[n]]]
        logits += [queries[n] @ items[j] for j in negs.tolist() if j != int(positive_index[n])]
        logits = torch.stack(logits) / temperature
        losses.append(-F.log_softmax(logits, 0)[0])
    return torch.stack(losses).mean()


@pytest.mark.parametrize("fused", ["0", "auto"], ids=["pytorch", "fused-if-built"])
@pytest.mark.parametrize(
    "shape, distinct",
    [((6, 5), 12), ((6, 5), 400), ((5,), 12)],
    ids=["per-token-few-items", "per-token-many-items", "shared"],
)
def test_sampled_softmax_matches_naive_and_masks_the_positive(shape, distinct, fused, monkeypatch):
    monkeypatch.setenv("GR_CPU_FUSED", fused)
    torch.manual_seed(0)
    queries = F.normalize(torch.randn(6, 4), dim=-1).requires_grad_(True)
    items = F.normalize(torch.randn(distinct, 4), dim=-1)
    positive_index = torch.randint(0, distinct, (6,))
    negative_index = torch.randint(0, distinct, shape)
    if negative_index.dim() == 2:
        negative_index[0, :2] = positive_index[0]  # sampled negatives equal to the positive
    loss = sampled_softmax_loss(queries, items, positive_index, negative_index, 0.05)
    expected = naive_sampled_softmax(queries, items, positive_index, negative_index, 0.05)
    torch.testing.assert_close(loss, expected)
    (grad,) = torch.autograd.grad(loss, queries)
    (expected_grad,) = torch.autograd.grad(expected, queries)
    torch.testing.assert_close(grad, expected_grad)


@pytest.mark.parametrize("fused", ["0", "auto"], ids=["dense-tiles", "fused-if-built"])
def test_sampled_softmax_per_token_paths_match_naive_in_value_and_both_gradients(monkeypatch, fused):
    """The PyTorch per-token path over few distinct items scores rows tile by tile: with 3-row
    tiles (7 rows: a partial last tile) the loss and the gradients of queries and items are the
    naive ones; so are those of the fused CPU kernel (gr.ops.native) where it builds."""
    monkeypatch.setenv("GR_CPU_FUSED", fused)
    monkeypatch.setattr(sampled_softmax_pytorch, "ROW_TILE_ELEMENTS", 3 * 12)
    torch.manual_seed(1)
    queries = F.normalize(torch.randn(7, 4), dim=-1).requires_grad_(True)
    items = F.normalize(torch.randn(12, 4), dim=-1).requires_grad_(True)
    positive_index = torch.randint(0, 12, (7,))
    negative_index = torch.randint(0, 12, (7, 5))
    negative_index[3, 1:] = positive_index[3]  # all but one negative masked
    loss = sampled_softmax_loss(queries, items, positive_index, negative_index, 0.05)
    expected = naive_sampled_softmax(queries, items, positive_index, negative_index, 0.05)
    torch.testing.assert_close(loss, expected)
    for got, want in zip(torch.autograd.grad(loss, (queries, items)), torch.autograd.grad(expected, (queries, items))):
        torch.testing.assert_close(got, want)


def autocast_batch(seed):
    """300 unit queries and 200 unit items of dim 16, with 32 negatives a row."""
    torch.manual_seed(seed)
    queries = F.normalize(torch.randn(300, 16), dim=-1).requires_grad_(True)
    items = F.normalize(torch.randn(200, 16), dim=-1).requires_grad_(True)
    return queries, items, torch.randint(0, 200, (300,)), torch.randint(0, 200, (300, 32))


def loss_and_grads_under_autocast(seed, bf16):
    """(loss, dqueries, ditems) of ``autocast_batch(seed)``, under CPU bf16 autocast or not."""
    queries, items, positive_index, negative_index = autocast_batch(seed)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = sampled_softmax_loss(queries, items, positive_index, negative_index, 0.05)
    return (loss, *torch.autograd.grad(loss, (queries, items)))


def test_sampled_softmax_under_bf16_autocast_stays_close_to_fp32(monkeypatch):
    """PyTorch path (GR_CPU_FUSED=0): under autocast the dot products run in bf16 (8 mantissa
    bits: cosines off by <= ~2^-8, logits by <= ~0.1 at temperature 0.05), the softmax in fp32.
    Measured: loss within 1e-4 relative, gradients within ~1% of their largest entry; asserted:
    1e-3 and 3%."""
    monkeypatch.setenv("GR_CPU_FUSED", "0")
    results = {bf16: loss_and_grads_under_autocast(2, bf16) for bf16 in (False, True)}
    assert results[True][0].dtype == torch.float32
    assert results[True][0].item() != results[False][0].item()  # the dot products really ran in bf16
    assert results[True][0].item() == pytest.approx(results[False][0].item(), rel=1e-3)
    for got, want in zip(results[True][1:], results[False][1:]):
        assert got.dtype == torch.float32
        assert (got - want).abs().max() <= 0.03 * want.abs().max()


def test_multitask_bce_weights_tasks():
    logits = {"a": torch.tensor([0.0, 2.0]), "b": torch.tensor([1.0, -1.0])}
    labels = {"a": torch.tensor([1.0, 0.0]), "b": torch.tensor([1.0, 1.0])}
    out = multitask_bce(logits, labels, {"b": 3.0})
    bce = {k: F.binary_cross_entropy_with_logits(logits[k], labels[k]) for k in logits}
    torch.testing.assert_close(out["loss"], bce["a"] + 3 * bce["b"])
    torch.testing.assert_close(out["bce/b"], bce["b"])


@pytest.mark.parametrize("negatives", ["token", "block", "batch"])
def test_retrieval_inputs_carry_distinct_sampled_items(negatives):
    """Per token [4, 8] negatives; per block of 3 scored tokens [2, 8]; per batch [8]."""
    config = RetrievalSection(num_negatives=8, negatives=negatives, negatives_block=3)
    task = RetrievalTask(config, num_items=50, item_embedding=lambda rows: rows)
    lengths = torch.tensor([3, 2])
    ids = KeyedJaggedTensor.from_lengths_sync(["item_id"], torch.tensor([4, 5, 6, 9, 4]), lengths)
    batch = GRInput(torch.tensor([0, 3, 5]), 3, sequence_ids=ids, labels={"next_item": torch.tensor([5, 6, 7, 4, -1])})
    inputs = task.training_inputs(batch, torch.Generator().manual_seed(0))
    sampled = inputs.sequence_ids.to_dict()[SAMPLED_ITEMS]
    distinct = sampled.values()
    assert sampled.lengths().tolist() == [distinct.numel(), 0]
    assert distinct.unique().numel() == distinct.numel()
    assert distinct[inputs.labels["positive_index"]].tolist() == [5, 6, 7, 4]
    negative_ids = distinct[inputs.labels["negative_index"]]
    assert negative_ids.shape == {"token": (4, 8), "block": (2, 8), "batch": (8,)}[negatives]
    assert int(negative_ids.min()) >= 0 and int(negative_ids.max()) < 50
    assert inputs.sequence_ids.to_dict()["item_id"].values().tolist() == [4, 5, 6, 9, 4]


def test_retrieval_inputs_look_up_the_whole_catalogue_when_draws_outnumber_it():
    """With 4 x 40 negative draws over 12 items (more than WHOLE_CATALOGUE_DRAWS per item) the
    sampled rows are the catalogue itself, ids index it directly, and the loss over them equals the
    loss over the distinct drawn items (the ids the distinct path would give, with the same draws)."""
    config = RetrievalSection(num_negatives=40, negatives="token")
    task = RetrievalTask(config, num_items=12, item_embedding=lambda rows: rows)
    ids = KeyedJaggedTensor.from_lengths_sync(["item_id"], torch.tensor([4, 5, 6, 9, 4]), torch.tensor([3, 2]))
    batch = GRInput(torch.tensor([0, 3, 5]), 3, sequence_ids=ids, labels={"next_item": torch.tensor([5, 6, 7, 4, -1])})
    inputs = task.training_inputs(batch, torch.Generator().manual_seed(0))
    assert inputs.sequence_ids.to_dict()[SAMPLED_ITEMS].values().tolist() == list(range(12))
    assert inputs.labels["positive_index"].tolist() == [5, 6, 7, 4]
    negatives = inputs.labels["negative_index"]
    assert negatives.shape == (4, 40)
    expected = rng.randint(12, (4, 40), torch.Generator().manual_seed(0))
    assert torch.equal(negatives, expected)  # the same draws, not remapped
    table = F.normalize(torch.randn(12, 4, generator=torch.Generator().manual_seed(1)), dim=-1)
    queries = F.normalize(torch.randn(4, 4, generator=torch.Generator().manual_seed(2)), dim=-1)
    distinct, index = torch.unique(
        torch.cat([inputs.labels["positive_index"], negatives.flatten()]), return_inverse=True
    )
    whole = sampled_softmax_loss(queries, table, inputs.labels["positive_index"], negatives, 0.05)
    drawn = sampled_softmax_loss(queries, table[distinct], index[:4], index[4:].view(4, 40), 0.05)
    torch.testing.assert_close(whole, drawn)


@pytest.mark.skipif(not X86, reason="gr's fused CPU kernels are built for x86-64 only")
def test_fused_sampled_softmax_runs_per_row_negatives_in_fp32_under_autocast_and_refuses_bad_ids(monkeypatch):
    """Per-row negatives: the fused kernel's dot products are fp32 whatever autocast says (the result
    equals fp32's); an id outside the table is an error, not a read out of bounds."""
    monkeypatch.setenv("GR_CPU_FUSED", "1")
    results = {}
    for bf16 in (False, True):
        with torch.profiler.profile() as profile:
            results[bf16] = loss_and_grads_under_autocast(3, bf16)
        assert "gr_cpu_loss::sampled_softmax_forward" in {e.key for e in profile.key_averages()}
    for got, want in zip(results[True], results[False]):
        assert torch.equal(got, want)
    queries, items, positive_index, negative_index = autocast_batch(3)
    negative_index[5, 3] = 200
    with pytest.raises(RuntimeError, match="an index is outside"):
        sampled_softmax_loss(queries, items, positive_index, negative_index, 0.05)


@pytest.mark.skipif(not X86, reason="gr's fused CPU kernels are built for x86-64 only")
@pytest.mark.parametrize("dim", [16, 50, 64, 100, 128])
def test_fused_sampled_softmax_matches_naive_for_every_row_width(monkeypatch, dim):
    """The kernel keeps rows of up to 64 (or 128) floats in vector registers, the last one masked,
    and scores 16 items at a time; other widths (100) run its scalar loops. 21 items a row: one
    group of 16 and a remainder."""
    monkeypatch.setenv("GR_CPU_FUSED", "1")
    torch.manual_seed(dim)
    queries = F.normalize(torch.randn(70, dim), dim=-1).requires_grad_(True)
    items = F.normalize(torch.randn(40, dim), dim=-1).requires_grad_(True)
    positive_index, negative_index = torch.randint(0, 40, (70,)), torch.randint(0, 40, (70, 20))
    negative_index[:, 7] = positive_index  # masked in every row
    loss = sampled_softmax_loss(queries, items, positive_index, negative_index, 0.05)
    expected = naive_sampled_softmax(queries, items, positive_index, negative_index, 0.05)
    torch.testing.assert_close(loss, expected)
    for got, want in zip(torch.autograd.grad(loss, (queries, items)), torch.autograd.grad(expected, (queries, items))):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("fused", ["0", "auto"], ids=["pytorch", "fused-if-built"])
@pytest.mark.parametrize("dim", [16, 50, 100])
def test_negatives_shared_by_blocks_of_rows_give_the_per_row_loss_of_those_negatives(monkeypatch, fused, dim):
    """rows_per_draw=8 over 37 rows: 5 blocks, row n scores negative_index[n % 5] (blocks of 8 and 7
    rows), with a negative equal to a row's own positive masked for that row only. Loss and the
    gradients of queries and items equal the naive per-row loss over those negatives; the fused
    kernel scores a block by GEMMs (a scalar row width, 100, included)."""
    monkeypatch.setenv("GR_CPU_FUSED", fused)
    torch.manual_seed(dim)
    queries = F.normalize(torch.randn(37, dim), dim=-1).requires_grad_(True)
    items = F.normalize(torch.randn(30, dim), dim=-1).requires_grad_(True)
    positive_index, negative_index = torch.randint(0, 30, (37,)), torch.randint(0, 30, (5, 21))
    negative_index[2, 4] = positive_index[7]  # row 7's positive, a plain negative for rows 2, 12, 17, ...
    negative_index[1, :20] = positive_index[36]  # the last row: one negative left
    per_row = negative_index[torch.arange(37) % 5]
    with torch.profiler.profile() as profile:
        loss = sampled_softmax_loss(queries, items, positive_index, negative_index, 0.05, rows_per_draw=8)
    if fused == "auto" and X86:
        assert "gr_cpu_loss::sampled_softmax_forward" in {e.key for e in profile.key_averages()}
    expected = naive_sampled_softmax(queries, items, positive_index, per_row, 0.05)
    torch.testing.assert_close(loss, expected)
    for got, want in zip(torch.autograd.grad(loss, (queries, items)), torch.autograd.grad(expected, (queries, items))):
        torch.testing.assert_close(got, want)


@pytest.mark.skipif(not X86, reason="gr's fused CPU kernels are built for x86-64 only")
def test_fused_block_negatives_under_bf16_autocast_score_by_bf16_math_gemms(monkeypatch):
    """Negatives shared by blocks of rows are scored by GEMMs, which under bf16 autocast round their
    operands to bf16 and sum in fp32 (gr.ops.native.cpu_bf16_math), backward included: the loss moves
    (measured: 7e-5 relative) and stays within 1e-3 of fp32's, the gradients within 3% of their
    largest entry (measured: ~0.6%)."""
    monkeypatch.setenv("GR_CPU_FUSED", "1")
    skip_without_bf16_instructions()
    queries, items, positive_index, _ = autocast_batch(4)
    negative_index = torch.randint(0, items.shape[0], (10, 40), generator=torch.Generator().manual_seed(4))  # 300 / 32
    results = {}
    for bf16 in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = sampled_softmax_loss(queries, items, positive_index, negative_index, 0.05, rows_per_draw=32)
        results[bf16] = (loss, *torch.autograd.grad(loss, (queries, items)))
    assert results[True][0].item() != results[False][0].item()
    assert results[True][0].item() == pytest.approx(results[False][0].item(), rel=1e-3)
    for got, want in zip(results[True][1:], results[False][1:]):
        assert got.dtype == torch.float32
        assert (got - want).abs().max() <= 0.03 * want.abs().max()


def test_negatives_shared_by_blocks_must_have_one_row_per_block():
    queries, items, positives = torch.randn(10, 4), torch.randn(8, 4), torch.zeros(10, dtype=torch.long)
    with pytest.raises(ValueError, match=r"negative_index has 2 rows, expected ceil\(10 / 4\)"):
        sampled_softmax_loss(queries, items, positives, torch.zeros(2, 5, dtype=torch.long), 0.05, 4)


@pytest.mark.skipif(not X86, reason="gr's fused CPU kernels are built for x86-64 only")
def test_fused_block_negatives_refuse_an_id_outside_the_table(monkeypatch):
    monkeypatch.setenv("GR_CPU_FUSED", "1")
    queries, items = torch.randn(10, 16), torch.randn(8, 16)
    negative_index = torch.zeros(3, 5, dtype=torch.long)
    negative_index[2, 4] = 8
    with pytest.raises(RuntimeError, match="an index is outside"):
        sampled_softmax_loss(queries, items, torch.zeros(10, dtype=torch.long), negative_index, 0.05, 4)


@pytest.mark.skipif(not X86, reason="gr's fused CPU kernels are built for x86-64 only")
def test_item_tables_past_the_fused_limit_take_the_pytorch_path(monkeypatch):
    """Backward keeps one fp32 copy of the item table per thread, so a catalogue past
    MAX_TABLE_ELEMENTS runs the PyTorch path (with the same result)."""
    monkeypatch.setenv("GR_CPU_FUSED", "1")
    torch.manual_seed(4)
    queries = F.normalize(torch.randn(20, 8), dim=-1)
    items = F.normalize(torch.randn(50, 8), dim=-1)
    positive_index, negative_index = torch.randint(0, 50, (20,)), torch.randint(0, 50, (20, 6))
    fused = sampled_softmax_loss(queries, items, positive_index, negative_index, 0.05)
    monkeypatch.setattr(sampled_softmax_cpu, "MAX_TABLE_ELEMENTS", items.numel() - 1)
    with torch.profiler.profile() as profile:
        plain = sampled_softmax_loss(queries, items, positive_index, negative_index, 0.05)
    assert "gr_cpu_loss::sampled_softmax_forward" not in {e.key for e in profile.key_averages()}
    torch.testing.assert_close(fused, plain)


def _ranking_batch(items, labels):
    """Two users, two candidates each (the trailing tokens), and the scored rows' outputs."""
    seq_offsets = torch.tensor([0, 3, 6])
    ids = torch.tensor([7, *items[:2], 8, *items[2:]])
    sequence_ids = KeyedJaggedTensor.from_lengths_sync(["item_id"], ids, torch.ones(6, dtype=torch.long))
    batch = GRInput(
        seq_offsets=seq_offsets,
        max_seq_len=3,
        num_targets=torch.tensor([2, 2]),
        sequence_ids=sequence_ids,
        labels={name: torch.tensor(value, dtype=torch.float32) for name, value in labels.items()},
    )
    logits = {name: torch.tensor([2.0, -1.0, 0.5, -0.5]) for name in labels}
    return GROutput(logits, torch.zeros(4, 1), torch.tensor([1, 2, 4, 5]), torch.tensor([0, 2, 4]), {}, {}), batch


def test_ranking_reports_positive_rates_and_the_popularity_baseline_and_warns_of_degenerate_labels(caplog):
    task = RankingTask(RankingSection(), ("watch", "like", "all"))
    popularity = torch.tensor([0, 9, 1, 5, 0, 0, 0, 0, 0])  # item 1 the most popular, then 3, then 2
    labels = {"watch": [1, 0, 1, 0], "like": [1, 0, 1, 0], "all": [1, 1, 1, 1]}
    task.start_evaluation(None)
    task.evaluation_step(*_ranking_batch([1, 2, 3, 4], labels), popularity)
    metrics = task.finish_evaluation()
    assert metrics["positive_rate/watch"] == 0.5 and metrics["positive_rate/all"] == 1.0
    # popularity scores 9, 1, 5, 0 for labels 1, 0, 1, 0: every positive above every negative
    assert metrics["popularity/auc/watch"] == 1.0 and math.isnan(metrics["popularity/auc/all"])
    assert "popularity/logloss/watch" not in metrics  # counts are no logits
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("'all': every label is 1" in w for w in warnings)
    assert any("'watch' and 'like' have identical labels" in w for w in warnings)
    task.start_evaluation(None)
    task.evaluation_step(*_ranking_batch([1, 2, 3, 4], labels), popularity)
    task.finish_evaluation()
    assert len([r for r in caplog.records if r.levelname == "WARNING"]) == len(warnings)  # once each


def test_ranking_training_labels_give_the_epochs_positive_rate():
    task = RankingTask(RankingSection(), ("watch",))
    output, batch = _ranking_batch([1, 2, 3, 4], {"watch": [1, 0, 0, 0]})
    for _ in range(3):
        task.loss(output, batch)
    assert task.finish_training_epoch() == {"positive_rate/watch": 0.25}
    assert task.finish_training_epoch() == {}  # a new epoch counts anew
