"""GRModel: the fixed forward ``split_input -> PrefixDNN -> HSTU -> PostfixDNN``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Sequence

import torch
from torch import Tensor, nn

from gr.hstu import HSTU, HSTUConfig
from gr.jagged import offsets_from_lengths, target_token_index, token_seq_ids
from gr.postfix_dnn import PostfixDNN
from gr.postfix_dnn.item_tower import ItemTower
from gr.prefix_dnn import PrefixDNN
from gr.sparse import SparseEmbeddings, TableConfig
from gr.sparse.keyed_jagged import KeyedJaggedTensor

# Members a GRModel subclass may not define: together they are the fixed pipeline.
FIXED_MEMBERS = ("forward", "hstu", "embed_features", "scored_rows", "__setattr__")


@dataclass
class GRInput:
    """What ``split_input`` returns: one jagged batch of B sequences.

    seq_offsets: [B+1] int64
    max_seq_len: int, >= the longest sequence (targets included)
    timestamps: [T] int64 seconds, or None when the time bias is off
    num_targets: [B] int64 or None; None -> every token is scored (autoregressive)
    sequence_ids: KJT with stride B; each key has exactly one id per token
        (lengths == sequence lengths). Keys the PrefixDNN does not read (e.g.
        sampled negatives through the same table) are looked up too and returned
        in ``GROutput.token_features``.
    token_dense: {name: [T, d]} dense per-token features
    common_ids: KJT with stride B, pooled per sequence (a bag of ids per sequence: one id,
        or a list-valued user feature's ids)
    token_lists: KJT with stride T, or None: list-valued token features (a movie's genres),
        each key one bag of ids per token (lengths [T], an empty bag allowed), pooled by
        its table (kind ``token_bag``, ``pooling`` sum or mean; an empty bag pools to zeros)
        into one [T, d] vector per token, returned with the sequence features
    common_dense: {name: [B, d]} dense per-request features
    labels: {name: tensor} for ``compute_loss``
    query_times: [T] int64 seconds or None: the time of the event each token predicts
        (the next token's; for the last history token and the targets, the request time).
        Read only when ``HSTUConfig.query_time`` is "next_event".
    """

    seq_offsets: Tensor
    max_seq_len: int
    timestamps: Optional[Tensor] = None
    num_targets: Optional[Tensor] = None
    sequence_ids: Optional[KeyedJaggedTensor] = None
    token_dense: Dict[str, Tensor] = field(default_factory=dict)
    common_ids: Optional[KeyedJaggedTensor] = None
    common_dense: Dict[str, Tensor] = field(default_factory=dict)
    labels: Dict[str, Tensor] = field(default_factory=dict)
    query_times: Optional[Tensor] = None
    token_lists: Optional[KeyedJaggedTensor] = None


@dataclass
class GROutput:
    """What the fixed forward returns.

    predictions: PostfixDNN outputs, {name: [N, ...]}
    hidden: [N, D] HSTU outputs at the scored rows
    row_index: [N] int64 flat token index of each scored row
    row_offsets: [B+1] int64, scored rows per sequence
    token_features: {feature: [T_f, d]} every looked-up sequence feature and token_dense
    common_features: {feature: [B, d]}
    new_user: PostfixDNN outputs {name: [B, ...]} of each sequence's user with no history
        (``GRModel.new_user_predictions``): in training, when the model has ``empty_history``; else empty
    """

    predictions: Dict[str, Tensor]
    hidden: Tensor
    row_index: Tensor
    row_offsets: Tensor
    token_features: Dict[str, Tensor]
    common_features: Dict[str, Tensor]
    new_user: Dict[str, Tensor] = field(default_factory=dict)


class GRModel(nn.Module):
    """A generative recommender: TorchRec tables, the user's PrefixDNN, HSTU, the user's PostfixDNN.

    Subclasses customise ``split_input`` (raw batch -> ``GRInput``) and
    ``compute_loss``; the forward itself and the HSTU module are fixed, and a
    subclass that defines them is refused when the class is created.

    ``item_tower`` (None unless ``model.item_tower`` configures one, set by the builder): the
    retrieval item tower (``gr.postfix_dnn.item_tower``), which replaces the looked-up rows of
    the items (history tokens, sampled items) by their item vectors before the PrefixDNN.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        clash = [name for name in FIXED_MEMBERS if name in cls.__dict__]
        if clash and not cls.__module__.startswith("torch."):
            raise TypeError(
                f"{cls.__name__} defines {clash}: the GRModel forward (split_input -> PrefixDNN -> HSTU -> "
                "PostfixDNN) and its HSTU module are fixed; override split_input/compute_loss, subclass "
                "PrefixDNN/PostfixDNN, and configure HSTU through HSTUConfig"
            )

    def __init__(
        self,
        hstu: HSTUConfig,
        prefix_dnn: PrefixDNN,
        postfix_dnn: PostfixDNN,
        tables: Sequence[TableConfig] = (),
    ) -> None:
        super().__init__()
        if not isinstance(prefix_dnn, PrefixDNN):
            raise TypeError(f"GRModel.prefix_dnn: expected a PrefixDNN subclass, got {type(prefix_dnn).__name__}")
        if not isinstance(postfix_dnn, PostfixDNN):
            raise TypeError(f"GRModel.postfix_dnn: expected a PostfixDNN subclass, got {type(postfix_dnn).__name__}")
        self.embeddings = SparseEmbeddings(tables) if tables else None
        self.prefix_dnn = prefix_dnn
        self.hstu = HSTU(hstu)
        self.postfix_dnn = postfix_dnn
        self.item_tower: Optional[ItemTower] = None
        # [D] the HSTU state of a user with no history, or None: set by the builder when the task learns it.
        self.empty_history: Optional[nn.Parameter]
        self.register_parameter("empty_history", None)

    def __setattr__(self, name: str, value: Any) -> None:
        # Re-assigning the same module is allowed: DistributedModelParallel re-sets every child it visits.
        if name == "hstu" and self.__dict__.get("_modules", {}).get("hstu", value) is not value:
            raise AttributeError("GRModel.hstu is fixed once built; change it through HSTUConfig")
        super().__setattr__(name, value)

    # ---- user hooks -------------------------------------------------------------
    def split_input(self, batch: Any) -> GRInput:
        """Raw batch -> GRInput. The default accepts a GRInput as is."""
        if isinstance(batch, GRInput):
            return batch
        raise TypeError(
            f"{type(self).__name__}.split_input: got a {type(batch).__name__}; override split_input to turn "
            "your batch into a GRInput"
        )

    def compute_loss(self, output: GROutput, inputs: GRInput) -> Dict[str, Tensor]:
        """-> {"loss": scalar, other logged terms...}. Override in a subclass."""
        raise NotImplementedError(f"{type(self).__name__}.compute_loss(output, inputs) -> {{'loss': tensor}}")

    # ---- the fixed pipeline -----------------------------------------------------
    def embed_features(self, inputs: GRInput) -> tuple:
        """Sparse lookups plus dense features -> ({name: [T_f, d]}, {name: [B, d]})."""
        token, common = {}, {}
        if inputs.sequence_ids is not None or inputs.common_ids is not None or inputs.token_lists is not None:
            if self.embeddings is None:
                raise ValueError("GRInput has sparse ids but the model was built without tables")
            token, common = self.embeddings(inputs.sequence_ids, inputs.common_ids, inputs.token_lists)
        for name, value in inputs.token_dense.items():
            token[name] = value
        for name, value in inputs.common_dense.items():
            common[name] = value
        return token, common

    @staticmethod
    def scored_rows(inputs: GRInput, total_tokens: int) -> tuple:
        """-> (row_index [N], row_offsets [B+1]): every token, or only the targets."""
        if inputs.num_targets is None:
            return torch.arange(total_tokens, device=inputs.seq_offsets.device), inputs.seq_offsets
        return target_token_index(inputs.seq_offsets, inputs.num_targets), offsets_from_lengths(inputs.num_targets)

    def forward(self, batch: Any) -> GROutput:
        inputs = self.split_input(batch)
        if not isinstance(inputs, GRInput):
            raise TypeError(f"{type(self).__name__}.split_input must return a GRInput, got {type(inputs).__name__}")
        token, common = self.embed_features(inputs)
        if self.item_tower is not None:
            token = self.item_tower.embed_tokens(token, inputs.sequence_ids)
        missing = [n for n in self.prefix_dnn.feature_names if n not in token]
        if missing:
            raise KeyError(
                f"PrefixDNN {type(self.prefix_dnn).__name__} reads {missing}, absent from the batch "
                f"(have {sorted(token)})"
            )
        x = self.prefix_dnn({name: token[name] for name in self.prefix_dnn.feature_names})
        h = self.hstu(
            x, inputs.seq_offsets, inputs.max_seq_len, inputs.timestamps, inputs.num_targets, inputs.query_times
        )
        row_index, row_offsets = self.scored_rows(inputs, h.shape[0])
        row_seq = token_seq_ids(row_offsets, row_index.numel())
        # Every token scored: h itself (a copy and, in backward, an index_add_ over all rows saved).
        # index_select otherwise: its backward, index_add_, is ~10x an indexing's index_put_ on CPU.
        hidden = h if inputs.num_targets is None else h.index_select(0, row_index)
        row_common = {name: common[name].index_select(0, row_seq) for name in self.postfix_dnn.common_feature_names}
        predictions = self.postfix_dnn(hidden, row_common)
        new_user = {}
        if self.training and self.empty_history is not None:
            new_user = self.new_user_predictions(common, inputs.seq_offsets.numel() - 1)
        return GROutput(predictions, hidden, row_index, row_offsets, token, common, new_user)

    def new_user_predictions(self, common: Dict[str, Tensor], rows: int) -> Dict[str, Tensor]:
        """PostfixDNN outputs {name: [rows, ...]} for ``rows`` users with no history: ``empty_history`` [D]
        as every user's HSTU output, with their common features ``common`` {name: [rows, d]}."""
        if self.empty_history is None:
            raise ValueError(f"{type(self).__name__}: built without empty_history (task.retrieval.new_user_query)")
        hidden = self.empty_history.unsqueeze(0).expand(rows, -1)
        return self.postfix_dnn(hidden, {name: common[name] for name in self.postfix_dnn.common_feature_names})
