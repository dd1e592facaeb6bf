"""Sparse lookups: "unique before lookup" dedup, padded storage, and a stable input layout per collection."""

import pytest
import torch
from torchrec import KeyedJaggedTensor

from gr.sparse import SparseEmbeddings, TableConfig
from gr.sparse.tables import storage_dim

TABLES = [
    TableConfig("item", 30, 6, ("item_id", "sampled_item_id")),  # stored 8 wide
    TableConfig("genre", 7, 8, ("genre",)),
    TableConfig("user", 5, 4, ("user_age",), kind="common"),
]


def embeddings(dedup):
    torch.manual_seed(0)
    return SparseEmbeddings(TABLES, dedup=dedup)


def batch():
    lengths = torch.tensor([5, 3, 4])
    items = torch.tensor([1, 2, 1, 1, 7, 2, 2, 9, 1, 7, 7, 3])
    genres = torch.tensor([0, 1, 0, 0, 2, 1, 1, 3, 0, 2, 2, 6])
    sampled = torch.tensor([9, 1, 25, 25, 4])
    return KeyedJaggedTensor.from_lengths_sync(
        ["item_id", "genre", "sampled_item_id"],
        torch.cat([items, genres, sampled]),
        torch.cat([lengths, lengths, torch.tensor([5, 0, 0])]),
    )


def test_dedup_gives_the_same_vectors_and_gradients_as_plain_lookup():
    plain, dedup = embeddings(False), embeddings(True)
    common = KeyedJaggedTensor.from_lengths_sync(["user_age"], torch.tensor([1, 3, 1]), torch.ones(3, dtype=torch.long))
    out_plain, pooled_plain = plain(batch(), common)
    out_dedup, pooled_dedup = dedup(batch(), common)
    assert sorted(out_plain) == sorted(out_dedup) == ["genre", "item_id", "sampled_item_id"]
    weights = {k: torch.randn_like(v) for k, v in out_plain.items()}
    for out in (out_plain, out_dedup):
        sum((out[k] * weights[k]).sum() for k in out).backward()
    for k in out_plain:
        torch.testing.assert_close(out_dedup[k], out_plain[k])
    torch.testing.assert_close(pooled_dedup["user_age"], pooled_plain["user_age"])
    for (name, p), (_, q) in zip(plain.named_parameters(), dedup.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


def test_each_distinct_id_of_a_table_is_looked_up_once():
    model = embeddings(True)
    seen = {}

    def record(module, args):
        seen[module] = args[0]

    for collection in model.sequence.values():
        collection.register_forward_pre_hook(record)
    model(batch(), None)
    item_kjt = seen[model.sequence["dim6"]].to_dict()
    # item_id and sampled_item_id share the item table: one lookup of their distinct ids.
    assert item_kjt["item_id"].values().tolist() == [1, 2, 3, 4, 7, 9, 25]
    assert item_kjt["sampled_item_id"].values().numel() == 0
    assert seen[model.sequence["dim8"]].to_dict()["genre"].values().tolist() == [0, 1, 2, 3, 6]


def test_tables_are_stored_padded_and_looked_up_at_their_dim():
    model = embeddings(True)
    assert storage_dim(6) == 8 and storage_dim(50) == 52 and storage_dim(8) == 8
    assert model.sequence["dim6"].embeddings["item"].weight.shape == (30, 8)
    assert model.table_weight("item").shape == (30, 6)
    out, _ = model(batch(), None)
    assert out["item_id"].shape == (12, 6)
    torch.testing.assert_close(out["item_id"][0], model.table_weight("item")[1])


@pytest.mark.parametrize("dedup", [False, True])
def test_a_collection_always_gets_all_its_features(dedup):
    model = embeddings(dedup)
    keys = []
    model.sequence["dim6"].register_forward_pre_hook(lambda module, args: keys.append(args[0].keys()))
    only_items = KeyedJaggedTensor.from_lengths_sync(["item_id"], torch.tensor([3, 4]), torch.tensor([1, 1]))
    out, _ = model(only_items, None)
    assert keys == [["item_id", "sampled_item_id"]]
    assert list(out) == ["item_id"]


def test_vectors_move_to_the_output_device():
    model = embeddings(True)
    model.output_device = torch.device("meta")  # stands in for an accelerator beside host-memory tables
    out, _ = model(batch(), None)
    assert {v.device.type for v in out.values()} == {"meta"}
    assert model.table_weight("item").device.type == "cpu"


def test_unknown_feature_is_refused():
    ids = KeyedJaggedTensor.from_lengths_sync(["movie"], torch.tensor([1]), torch.tensor([1]))
    with pytest.raises(ValueError, match=r"features \['movie'\] have no table"):
        embeddings(True)(ids, None)


@pytest.mark.parametrize("num_rows", [50, 10**9], ids=["mask", "sort"])
def test_unique_ids_maps_every_id_to_its_distinct_row(num_rows):
    from gr.sparse.dedup import unique_ids

    ids = torch.tensor([7, 3, 7, 49, 3, 0, 7])
    distinct, inverse = unique_ids(ids, num_rows)
    assert distinct.tolist() == [0, 3, 7, 49]
    assert torch.equal(distinct[inverse], ids)
