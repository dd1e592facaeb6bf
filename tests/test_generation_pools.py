import torch

from gr.generation.draft_tree import DraftTree, tree_from_counted_paths, tree_from_paths
from gr.generation.pools import GroupedPools, SequencePool


def test_tree_from_paths_shares_prefixes_and_respects_the_budget():
    tree = tree_from_paths([(5, 6, 7), (5, 6, 9), (5, 8), (4,)], max_nodes=5)
    assert tree.items.tolist() == [5, 6, 7, 9, 8]
    assert tree.parents.tolist() == [-1, 0, 1, 1, 0]
    assert tree.depths().tolist() == [1, 2, 3, 3, 2]
    assert [[tree.items[i].item() for i in b] for b in tree.branches()] == [[5, 6, 7], [5, 6, 9], [5, 8]]


def test_counted_paths_keep_the_most_frequent_prefixes_first():
    # one path per occurrence, as pools return them: 9 starts three continuations, 5 one longer one
    paths = [((5, 6, 7, 8), 1), ((9, 1), 1), ((9, 2), 1), ((9, 1, 3), 1)]
    tree = tree_from_counted_paths(paths, max_nodes=3)
    assert tree.items.tolist() == [9, 1, 5], "9 (weight 3), then 9->1 (2), then 5 (1, the earliest path)"
    assert tree.parents.tolist() == [-1, 0, -1]
    whole = tree_from_counted_paths(paths, max_nodes=32)
    assert sorted(whole.items.tolist()) == [1, 2, 3, 5, 6, 7, 8, 9]
    assert bool((whole.parents < torch.arange(whole.num_nodes)).all()), "parents come before children"


def test_ancestor_mask_lets_a_node_see_only_its_branch():
    tree = DraftTree(torch.tensor([1, 2, 3, 4]), torch.tensor([-1, 0, 0, 2]))
    expected = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(tree.ancestor_mask(), expected)


def test_parents_after_children_are_refused():
    try:
        DraftTree(torch.tensor([1, 2]), torch.tensor([1, -1]))
    except ValueError as err:
        assert "parent" in str(err)
    else:
        raise AssertionError("expected a ValueError")


def test_pool_prefers_the_longest_matching_suffix_then_backs_off():
    pool = SequencePool(max_ngram=2)
    pool.add([1, 2, 3, 4])
    pool.add([9, 2, 3, 7])
    pool.add([5, 3, 8])
    # context ends with (2, 3): both sequences that contain it continue.
    conts = pool.continuations([0, 2, 3], depth=2)
    assert sorted(conts) == [((4,), 1), ((7,), 1)]
    # (6, 3) never occurs: back off to the unigram (3,), which occurs three times.
    assert sorted(c for c, _ in pool.continuations([6, 3], depth=1)) == [(4,), (7,), (8,)]
    assert pool.continuations([42], depth=3) == []


def test_request_sequence_is_searched_as_a_temporary_branch():
    pool = SequencePool(max_ngram=2)
    pool.add([1, 2, 3])
    own = SequencePool(max_ngram=2)
    own.add([7, 8, 9, 7, 8])
    tree = pool.propose([9, 7, 8], depth=2, max_nodes=4, extra=[own])
    assert tree.items.tolist() == [9, 7]
    assert len(pool) == 1


def test_extending_a_sequence_indexes_exactly_what_adding_it_whole_would():
    whole, grown = SequencePool(max_ngram=3), SequencePool(max_ngram=3)
    whole.add([4, 5, 6, 4, 5, 7, 4, 5])
    sid = grown.add([4, 5])
    for part in ([6, 4], [], [5, 7, 4], [5]):
        grown.extend(sid, part)
    assert grown.sequences == whole.sequences
    for context in ([4, 5], [5], [6, 4, 5], [7, 4], [9]):
        assert grown.continuations(context, depth=3) == whole.continuations(context, depth=3)


def test_grouped_pools_route_by_embedding_and_by_attribute():
    embeddings = torch.tensor([[0.0, 0.0], [0.1, 0.0], [10.0, 10.0], [10.1, 10.0]])
    seqs = [[1, 2, 3], [1, 2, 4], [7, 8, 9], [7, 8, 6]]
    pools = GroupedPools.build(seqs, embeddings, num_groups=2, attributes=["young", "young", "old", "old"])
    near_second = pools.route(torch.tensor([9.5, 9.9]))
    assert {s[0] for s in near_second.sequences} == {7}
    assert {s[0] for s in pools.route(attribute="young").sequences} == {1}
    assert len(pools.route(attribute="unknown")) == 4
