"""Relaxed verification with real thresholds: top_k below the catalogue and a probability floor
above zero change what is accepted (and the slate), every accepted item stays within the model's
top_k at a probability of at least min_prob, and top_k = 1 (like strict) returns greedy's items."""

import pytest
import torch
import torch.nn.functional as F

from gr.generation.decoding import Relaxed, greedy, speculative_greedy
from gr.generation.drafts import RankingDrafter
from gr.index.exact import ExactIndex
from helpers.generation import NUM_ITEMS, REQUEST_TIME, begin, make_model, random_user

pytestmark = pytest.mark.usefixtures("single_thread")

USERS = range(80, 86)
K = 10
TEMPERATURE = 0.1


@pytest.fixture(scope="module")
def model():
    return make_model()


@pytest.fixture(scope="module")
def index(model):
    return ExactIndex(F.normalize(model.table, dim=-1))


def run(model, index, verification):
    """-> per user: (history, timestamps, speculative slate, greedy slate), and total accepted drafts."""
    out, accepted = [], 0
    for seed in USERS:
        items, ts = random_user(seed)
        got = speculative_greedy(
            model,
            index,
            begin(model, items, ts),
            K,
            REQUEST_TIME,
            RankingDrafter(index, widths=(6, 3, 2)),
            verification=verification,
        )
        want = greedy(model, index, begin(model, items, ts), K, REQUEST_TIME).items
        out.append((items, ts, got.items, want))
        accepted += got.stats.accepted
    return out, accepted


def rank_and_prob(model, index, items, ts, slate, position, temperature):
    """Where slate[position] ranks (0 = best) among the model's allowed items after the history and
    slate[:position], by a full forward, and its softmax(score / temperature) probability."""
    seq = items.tolist() + slate[:position]
    times = ts.tolist() + [REQUEST_TIME] * position
    with torch.no_grad():
        hidden = model.engine.hstu(
            model.item_tokens(torch.tensor(seq)),
            torch.tensor([0, len(seq)]),
            len(seq),
            torch.tensor(times),
            None,
            torch.tensor(times[1:] + [REQUEST_TIME]),
        )
    scores = index.scores(model.queries(hidden[-1:]))[0]
    scores[torch.tensor(seq)] = float("-inf")
    item = slate[position]
    return int((scores > scores[item]).sum()), float(torch.softmax(scores / temperature, 0)[item])


def test_relaxed_top_1_accepts_only_the_greedy_choice(model, index):
    slates, _ = run(model, index, Relaxed(top_k=1, min_prob=0.0, temperature=TEMPERATURE))
    assert all(got == want for _, _, got, want in slates)


def test_relaxed_top_k_accepts_more_than_strict_and_changes_slates_within_the_model_top_k(model, index):
    _, strict = run(model, index, Relaxed(top_k=1, min_prob=0.0, temperature=TEMPERATURE))
    top_k = 3
    slates, relaxed = run(model, index, Relaxed(top_k=top_k, min_prob=0.0, temperature=TEMPERATURE))
    assert relaxed > strict, (relaxed, strict)
    assert any(got != want for _, _, got, want in slates), "accepting runners-up must change some slate"
    for items, ts, got, _ in slates:
        assert len(set(got)) == K and not set(got) & set(items.tolist())
        for position in range(K):
            rank, _ = rank_and_prob(model, index, items, ts, got, position, TEMPERATURE)
            assert rank < top_k, (got, position, rank)


def test_a_probability_floor_rejects_unlikely_drafts_and_keeps_accepted_items_above_it(model, index):
    loose, accepted_loose = run(model, index, Relaxed(top_k=NUM_ITEMS, min_prob=0.0, temperature=TEMPERATURE))
    floor = 0.2
    slates, accepted_floor = run(model, index, Relaxed(top_k=NUM_ITEMS, min_prob=floor, temperature=TEMPERATURE))
    assert accepted_floor < accepted_loose, (accepted_floor, accepted_loose)
    assert [got for *_, got, _ in slates] != [got for *_, got, _ in loose]
    for items, ts, got, _ in slates:
        for position in range(K):
            rank, prob = rank_and_prob(model, index, items, ts, got, position, TEMPERATURE)
            assert rank == 0 or prob >= floor - 1e-4, (got, position, rank, prob)
