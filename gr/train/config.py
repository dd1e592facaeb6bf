"""TrainConfig: the whole recipe YAML, validated up front, every key overridable by dotted path.

Sections: ``data`` (``gr.data.DataConfig``), ``model`` (``hstu``: HSTUConfig fields;
``tables``: embedding tables; ``prefix_dnn`` / ``postfix_dnn``: ``{class: import.path,
kwargs: {...}}``), ``sparse`` (table placement, id dedup, default embedding optimizer),
``task`` (``retrieval`` / ``ranking`` loss and metric settings; which one runs is
``data.task``), ``optimizer`` (the dense parameters'), ``trainer`` and ``distributed``
(how dense parameters are spread over ranks) and ``warm_start`` (the recipe a run started
with ``trainer.init_from`` follows: ``apply_warm_start``). Any invalid or
unknown key raises ValueError naming ``section.key`` and what was expected.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import re
import sys
from dataclasses import InitVar, dataclass, field, replace
from pathlib import Path
from typing import Any, Collection, Dict, Mapping, Optional, Sequence, Tuple

import yaml

from gr.data.config import DataConfig, iso_seconds
from gr.hstu.config import HSTUConfig
from gr.sparse.config import PLACEMENTS, SPARSE_BACKENDS, TableConfig
from gr.sparse.optimizer import EmbeddingOptimizerConfig
from gr.utils.atomic import write_text
from gr.utils.config_checks import (
    BETAS,
    BOOL,
    NAME,
    PROBABILITY,
    Check,
    Section,
    checked,
    int_at_least,
    is_int,
    is_number,
    known_keys,
    list_of,
    number_in,
    one_of,
    optional,
)

# The shipped PrefixDNN, and the PostfixDNN per task, used when the config names no class.
DEFAULT_POSTFIX = {"retrieval": "gr.postfix_dnn.RetrievalHead", "ranking": "gr.postfix_dnn.MMoERankingHead"}
DEFAULT_PREFIX = "gr.prefix_dnn.MLPTokenEncoder"
DEFAULT_MODEL = "gr.model.GRModel"
NEGATIVE_SHARING = ("token", "block", "batch")
DENSE_OPTIMIZERS = ("adamw", "adam", "sgd")
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")
ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "npu")
GPU_ACCELERATORS = ("gpu", "cuda")
# "none": every rank holds the dense model whole (DDP); "fsdp2": the HSTU stack is sharded
# over ranks with FSDP2 (``fully_shard``), the DNNs stay replicated (DDP).
DENSE_SHARDINGS = ("none", "fsdp2")
TABLE_OPTIMIZER_STATES = ("carry", "reset")
DENSE_OPTIMIZER_STATES = ("fresh", "carry")
LR_DECAYS = ("none", "linear", "cosine")
DAY_SECONDS = 86_400
# The key each warm_start key sets under trainer.init_from (``apply_warm_start``).
WARM_START_KEYS = {
    "replay": "data.replay",
    "max_epochs": "trainer.max_epochs",
    "early_stopping_patience": "trainer.early_stopping_patience",
    "lr": "optimizer.lr",
    "warmup_steps": "optimizer.warmup_steps",
    "lr_decay": "optimizer.lr_decay",
    "lr_floor": "optimizer.lr_floor",
}
# The data time each warm_start key in days sets, and the data time it counts back from.
WARM_START_DAYS = {"replay_days": ("replay_start", "train_start"), "validation_days": ("val_start", "split_time")}

TOP_K: Check = list_of(int_at_least(1), non_empty=True)
DURATION_UNITS = {"s": 1, "m": 60, "h": 3600}
DURATION = re.compile(r"^([1-9][0-9]*)(s|m|h)$")
PUBLISH_EVERY: Check = (
    (lambda v: (is_int(v) and v >= 1) or (isinstance(v, str) and DURATION.match(v) is not None)),
    'a number of training steps >= 1 or a duration such as "90s", "10m", "1h"',
)


def publish_interval(every: Any) -> Tuple[int, float]:
    """``trainer.publish_every`` (valid) -> (steps, seconds): one of them 0 (not by that measure)."""
    if is_int(every):
        return int(every), 0.0
    match = DURATION.match(str(every))
    assert match is not None  # validated by PUBLISH_EVERY
    return 0, float(int(match.group(1)) * DURATION_UNITS[match.group(2)])


@dataclass(frozen=True)
class ModuleSpec:
    """A user-replaceable module: ``class`` (import path) and constructor ``kwargs``.

    The builder fills constructor arguments the config leaves out when their names are
    ``hidden_dim``, ``feature_dims``, ``common_dims``, ``embedding_dim`` or ``tasks``
    (see ``gr.train.build``).
    """

    class_path: str
    kwargs: Dict[str, Any] = field(default_factory=dict)
    where: InitVar[str] = "model.module"

    def __post_init__(self, where: str) -> None:
        if not isinstance(self.kwargs, Mapping):
            raise ValueError(f"{where}.kwargs: expected a mapping of constructor arguments, got {self.kwargs!r}")

    def check_class(self, where: str, base: type) -> None:
        """Import the class and check it against ``base`` and the kwargs. Imports run code, so
        ``TrainConfig.from_dict`` calls this only once everything else has validated."""
        cls = import_class(self.class_path, f"{where}.class")
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise ValueError(f"{where}.class: {self.class_path} is not a {base.__name__} subclass")
        parameters = inspect.signature(cls.__init__).parameters
        if not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
            unknown = sorted(set(self.kwargs) - set(parameters) - {"self"})
            if unknown:
                raise ValueError(
                    f"{where}.kwargs: {cls.__name__} takes no argument(s) {unknown}; "
                    f"it takes {sorted(set(parameters) - {'self'})}"
                )

    @property
    def cls(self) -> type:
        return import_class(self.class_path, "class")

    def to_dict(self) -> Dict[str, Any]:
        return {"class": self.class_path, "kwargs": dict(self.kwargs)}

    @classmethod
    def parse(cls, values: Any, where: str, default_class: str) -> "ModuleSpec":
        if values is not None and not isinstance(values, Mapping):
            raise ValueError(f"{where}: expected {{class: import.path, kwargs: {{...}}}}, got {values!r}")
        values = dict(values or {})
        unknown = sorted(set(values) - {"class", "kwargs"})
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}; expected 'class' (import path) and 'kwargs'")
        class_path = values.get("class") or default_class
        if not isinstance(class_path, str):
            raise ValueError(f"{where}.class: expected an import path like 'package.module.Class', got {class_path!r}")
        return cls(class_path, dict(values.get("kwargs") or {}), where=where)


def add_code_path(directories: Sequence[str]) -> None:
    """Append ``directories`` to ``sys.path`` (those not there yet), so class paths under them import."""
    for directory in directories:
        if directory not in sys.path:
            sys.path.append(directory)


def import_root(class_path: str) -> Optional[str]:
    """The directory ``class_path``'s top-level package was imported from, absolute, when a run must
    record it: the working directory, or a directory not on ``sys.path``. None for gr's own
    classes and for installed packages (importable anywhere)."""
    module_name = class_path.rpartition(".")[0]
    module = sys.modules.get(module_name)
    file = getattr(module, "__file__", None)
    if module_name.split(".")[0] == "gr" or file is None:
        return None
    root = Path(file).resolve().parents[module_name.count(".")]
    if Path(file).name == "__init__.py":
        root = root.parent
    on_path = {str(Path(p or os.getcwd()).resolve()) for p in sys.path}
    cwd = str(Path.cwd().resolve())
    return str(root) if str(root) == cwd or str(root) not in on_path else None


def import_class(path: str, where: str) -> type:
    module_name, _, name = path.rpartition(".")
    if not module_name:
        raise ValueError(f"{where}: expected an import path like 'package.module.Class', got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"{where}: cannot import module {module_name!r} ({error})") from error
    if not hasattr(module, name):
        raise ValueError(f"{where}: module {module_name!r} has no {name!r}")
    return getattr(module, name)


@dataclass(frozen=True)
class ItemTowerSection(Section):
    """Retrieval's item-side embedding from the item's features as well as its id row
    (``gr.postfix_dnn.item_tower``): ``features``, declared item features (categorical, list-valued
    or dense) that an encoder of its own turns into a vector added to the item's row; in training
    each looked-up item's row is zeroed with probability ``id_dropout``, so the features alone
    learn to score; ``mlp_dims``: the encoder's hidden layers (none: one projection);
    ``feature_loss_weight``: the weight of a second sampled softmax in which each target is scored
    by its features alone (no id row) against the same negatives (0: none); ``popularity``: the
    encoder also reads each item's ``log1p`` training count (a new item's: the count given to
    ``gr items add``), so an item without a trained row is placed by its popularity too."""

    features: Tuple[str, ...] = checked((), list_of(NAME, non_empty=True))
    id_dropout: float = checked(0.2, PROBABILITY)
    mlp_dims: Tuple[int, ...] = checked((), list_of(int_at_least(1)))
    feature_loss_weight: float = checked(0.0, number_in(0.0))
    popularity: bool = checked(False, BOOL)
    where: InitVar[str] = "model.item_tower"

    def __post_init__(self, where: str) -> None:
        self.validate(where)
        repeated = sorted({f for f in self.features if self.features.count(f) > 1})
        if repeated:
            raise ValueError(f"{where}.features: {repeated} named more than once")

    def to_dict(self) -> Dict[str, Any]:
        return {
            "features": list(self.features),
            "id_dropout": self.id_dropout,
            "mlp_dims": list(self.mlp_dims),
            "feature_loss_weight": self.feature_loss_weight,
            "popularity": self.popularity,
        }


@dataclass(frozen=True)
class ModelSection:
    """hstu: HSTUConfig; tables: embedding table mappings (``TableConfig`` fields;
    ``num_embeddings`` may be null: the data's cardinality); prefix_dnn / postfix_dnn;
    ``class`` (``class_path`` here): the GRModel subclass to build, by import path, checked
    after the rest of the section. It is built as ``cls(hstu, prefix_dnn, postfix_dnn,
    tables)`` and its ``split_input`` receives each batch (a GRInput with every feature).
    item_tower: retrieval's item tower (``ItemTowerSection``), or None: items are their rows."""

    hstu: HSTUConfig
    tables: Tuple[Mapping[str, Any], ...]
    prefix_dnn: ModuleSpec
    postfix_dnn: ModuleSpec
    class_path: str = DEFAULT_MODEL
    code_path: Tuple[str, ...] = ()
    item_tower: Optional[ItemTowerSection] = None

    @classmethod
    def from_dict(cls, values: Any, where: str, task: str) -> "ModelSection":
        values = dict(values) if isinstance(values, Mapping) else values
        class_path = values.pop("class", None) if isinstance(values, dict) else None
        values = known_keys(cls, values, where, ignore=("class_path",))
        code_path = values.get("code_path") or ()
        if not isinstance(code_path, (list, tuple)) or not all(isinstance(d, str) and d for d in code_path):
            raise ValueError(f"{where}.code_path: expected a list of directories, got {code_path!r}")
        add_code_path(code_path)  # before any class path is imported
        tables = values.get("tables") or []
        if not isinstance(tables, (list, tuple)) or not tables:
            raise ValueError(f"{where}.tables: expected a non-empty list of tables, got {tables!r}")
        for i, table in enumerate(tables):
            TableConfig.from_dict(table, f"{where}.tables[{i}]")
        names = [t["name"] for t in tables]
        if len(set(names)) != len(names):
            raise ValueError(f"{where}.tables: duplicate table names {names}")
        tower = values.get("item_tower")
        if tower is not None and task != "retrieval":
            raise ValueError(f"{where}.item_tower: an item tower embeds retrieval's items; data.task is {task!r}")
        section = cls(
            hstu=HSTUConfig.from_dict(values.get("hstu"), f"{where}.hstu"),
            tables=tuple(dict(t) for t in tables),
            prefix_dnn=ModuleSpec.parse(values.get("prefix_dnn"), f"{where}.prefix_dnn", DEFAULT_PREFIX),
            postfix_dnn=ModuleSpec.parse(values.get("postfix_dnn"), f"{where}.postfix_dnn", DEFAULT_POSTFIX[task]),
            class_path=DEFAULT_MODEL if class_path is None else class_path,
            code_path=tuple(code_path),
            item_tower=None if tower is None else ItemTowerSection.from_dict(tower, f"{where}.item_tower"),
        )
        section.model_class(f"{where}.class")
        return section

    def model_class(self, where: str = "model.class") -> type:
        """The GRModel subclass ``class`` names; ValueError naming ``where`` otherwise."""
        from gr.model import GRModel  # the model stack (torch): imported to check a class, never to read a config

        if not isinstance(self.class_path, str):
            raise ValueError(f"{where}: expected an import path like 'package.module.Class', got {self.class_path!r}")
        model_class = import_class(self.class_path, where)
        if not (isinstance(model_class, type) and issubclass(model_class, GRModel)):
            raise ValueError(f"{where}: {self.class_path} is not a GRModel subclass")
        return model_class

    def check_classes(self, where: str) -> None:
        """Import and check prefix_dnn.class and postfix_dnn.class (``ModuleSpec.check_class``)."""
        from gr.postfix_dnn import PostfixDNN  # the model stack (torch), as in model_class
        from gr.prefix_dnn import PrefixDNN

        self.prefix_dnn.check_class(f"{where}.prefix_dnn", PrefixDNN)
        self.postfix_dnn.check_class(f"{where}.postfix_dnn", PostfixDNN)

    def table_with(self, feature: str) -> Optional[Mapping[str, Any]]:
        return next((t for t in self.tables if feature in t["features"]), None)

    def to_dict(self) -> Dict[str, Any]:
        return {
            "class": self.class_path,
            "hstu": self.hstu.to_dict(),
            "tables": [dict(t) for t in self.tables],
            "prefix_dnn": self.prefix_dnn.to_dict(),
            "postfix_dnn": self.postfix_dnn.to_dict(),
            "code_path": list(self.code_path),
            **({} if self.item_tower is None else {"item_tower": self.item_tower.to_dict()}),
        }

    def with_code_roots(self) -> "ModelSection":
        """This section with ``code_path`` absolute and extended by the directory each of its
        classes was imported from, where that is the working directory or off ``sys.path``: a
        run's config then imports them from any working directory."""
        roots = [str(Path(d).resolve()) for d in self.code_path]
        for class_path in (self.class_path, self.prefix_dnn.class_path, self.postfix_dnn.class_path):
            root = import_root(class_path)
            if root is not None and root not in roots:
                roots.append(root)
        return replace(self, code_path=tuple(roots))


@dataclass(frozen=True)
class SparseSection(Section):
    """placement: "device" (tables with the dense model) or "host" (tables in host memory);
    dedup: look each distinct id of a batch up once; optimizer: tables' default optimizer;
    backend: "torchrec" (TorchRec tables, sharded over ranks) or "torch" (plain torch embeddings
    and optimizers on one rank, no TorchRec or FBGEMM needed; same checkpoints and exports)."""

    placement: str = checked("device", one_of(*PLACEMENTS))
    dedup: bool = checked(True, BOOL)
    optimizer: EmbeddingOptimizerConfig = field(default_factory=EmbeddingOptimizerConfig)
    backend: str = checked("torchrec", one_of(*SPARSE_BACKENDS))
    where: InitVar[str] = "sparse"

    def __post_init__(self, where: str) -> None:
        self.validate(where)

    @classmethod
    def from_dict(cls, values: Any, where: str) -> "SparseSection":
        values = known_keys(cls, values, where)
        if "optimizer" in values:
            values["optimizer"] = EmbeddingOptimizerConfig.from_dict(values["optimizer"], f"{where}.optimizer")
        return cls(**values, where=where)


@dataclass(frozen=True)
class RetrievalSection(Section):
    """Sampled softmax over ``num_negatives`` items drawn uniformly from the catalogue, per
    token ("token": the HSTU paper's), per block of about ``negatives_block`` scored tokens
    ("block": the batch's tokens are dealt to the blocks in turn, so every token still gets
    ``num_negatives`` uniform draws and neighbouring tokens of a sequence never share them; the
    CPU kernel scores a block by one matrix product instead of a gather per dot product), or
    shared by all tokens of a batch ("batch"); logits are cosine similarities / ``temperature``.
    Evaluation ranks the whole catalogue: HR@k and NDCG@k for k in ``top_k``, and MRR.

    new_user_query: learn the HSTU state of a user with no history (``GRModel.empty_history``), trained on
    each sequence's first event (when the sequence starts at the user's first event) through the
    PostfixDNN with the user's common features, with the same loss and kind of negatives as the other
    tokens; each such target weighs ``new_user_weight`` tokens. null: on when the PostfixDNN reads
    common features (the query then differs by user), off otherwise."""

    num_negatives: int = checked(128, int_at_least(1))
    temperature: float = checked(0.05, number_in(0.0, open_low=True))
    negatives: str = checked("token", one_of(*NEGATIVE_SHARING))
    negatives_block: int = checked(32, int_at_least(1))
    top_k: Tuple[int, ...] = checked((10, 50, 200), TOP_K)
    item_feature: str = checked("item_id", NAME)
    new_user_query: Optional[bool] = checked(None, optional(BOOL))
    new_user_weight: float = checked(1.0, number_in(0.0))
    where: InitVar[str] = "task.retrieval"

    def __post_init__(self, where: str) -> None:
        self.validate(where)

    def metric_names(self) -> Tuple[str, ...]:
        return (*(f"{m}@{k}" for m in ("hr", "ndcg") for k in self.top_k), "mrr")

    @property
    def rows_per_draw(self) -> int:
        """Scored tokens sharing one draw of negatives: 1 for "token", ``negatives_block`` for "block"
        (and 1 for "batch", whose single draw the loss takes as [K])."""
        return self.negatives_block if self.negatives == "block" else 1


@dataclass(frozen=True)
class RankingSection(Section):
    """Multi-task BCE, one term per data task, weighted by ``task_weights`` (default 1)."""

    task_weights: Dict[str, float] = field(default_factory=dict)
    where: InitVar[str] = "task.ranking"

    def __post_init__(self, where: str) -> None:
        if not isinstance(self.task_weights, Mapping):
            raise ValueError(f"{where}.task_weights: expected a mapping {{task: weight}}, got {self.task_weights!r}")
        for name, weight in self.task_weights.items():
            if not is_number(weight) or weight < 0:
                raise ValueError(f"{where}.task_weights.{name}: expected a number >= 0, got {weight!r}")


@dataclass(frozen=True)
class TaskSection:
    retrieval: RetrievalSection = field(default_factory=RetrievalSection)
    ranking: RankingSection = field(default_factory=RankingSection)

    @classmethod
    def from_dict(cls, values: Any, where: str) -> "TaskSection":
        values = known_keys(cls, values, where)
        return cls(
            RetrievalSection.from_dict(values.get("retrieval"), f"{where}.retrieval"),
            RankingSection.from_dict(values.get("ranking"), f"{where}.ranking"),
        )


@dataclass(frozen=True)
class OptimizerSection(Section):
    """The dense parameters' optimizer (embedding tables have theirs in ``sparse``);
    linear warm-up over ``warmup_steps`` steps, then constant (``lr_decay`` "none"), or decaying
    "linear"ly or on a half "cosine" from ``lr`` to ``lr_floor`` * ``lr`` at the run's last step
    (``trainer.max_epochs`` epochs; ``gr.train.module.lr_factor``)."""

    type: str = checked("adamw", one_of(*DENSE_OPTIMIZERS))
    lr: float = checked(1e-3, number_in(0.0, open_low=True))
    betas: Tuple[float, float] = checked((0.9, 0.98), BETAS)
    eps: float = checked(1e-8, number_in(0.0, open_low=True))
    weight_decay: float = checked(0.0, number_in(0.0))
    warmup_steps: int = checked(0, int_at_least(0))
    lr_decay: str = checked("none", one_of(*LR_DECAYS))
    lr_floor: float = checked(0.0, number_in(0.0, 1.0))
    where: InitVar[str] = "optimizer"

    def __post_init__(self, where: str) -> None:
        self.validate(where)


@dataclass(frozen=True)
class TrainerSection(Section):
    """The Lightning loop. ``devices``: processes on this node ("auto": torchrun's
    LOCAL_WORLD_SIZE, else 1). ``monitor``: the validation metric that picks the best
    checkpoint (null: val/ndcg@<first top_k> for retrieval, val/auc for ranking).
    ``precision``: "32-true", or "bf16-mixed" (the step runs under bf16 autocast, HSTU and
    DNNs included, while parameters and optimizer state stay fp32; runs on CPU, where gr's fused
    kernels multiply bf16-rounded operands on fp32 activations: ``gr.ops.native.cpu_bf16_math``), or
    "16-mixed" (fp16 with loss scaling, GPU only). ``stochastic_length_alpha``: null (off)
    or alpha in (1, 2]: training histories longer than data.max_seq_len^(alpha/2) are
    subsampled to that length with probability 1 - max_seq_len^alpha / length^2
    (``gr.data.stochastic_length``; never at evaluation). ``memory_check``: refuse a CPU run
    whose ``gr plan`` estimate exceeds the machine's available memory (``gr.train.memory.check_memory_fits``).
    ``init_from``: a trained run to start from (``gr train --init-from RUN``; ``gr.train.warm_start``).
    ``track_rows``: record the rows each training step updates (``gr.sparse.touched``), so a delta
    export of the run reads only those rows. ``publish_every``: null (off), N training steps, or a
    duration ("90s", "10m", "1h"): every so often the run publishes a delta export into
    ``publish_dir`` (``gr.export.publish``; rows tracked), against ``publish_base`` (a full export
    of the run it warm-starts from) or a full export it publishes first."""

    max_epochs: int = checked(100, int_at_least(1))
    seed: int = checked(0, int_at_least(0))
    accelerator: str = checked("auto", one_of(*ACCELERATORS))
    devices: Any = checked("auto", ((lambda v: v == "auto" or (is_int(v) and v >= 1)), "'auto' or an int >= 1"))
    num_nodes: int = checked(1, int_at_least(1))
    monitor: Optional[str] = checked(None, optional(NAME))
    monitor_mode: str = checked("max", one_of("max", "min"))
    early_stopping_patience: int = checked(0, int_at_least(0))
    gradient_clip_val: float = checked(0.0, number_in(0.0))
    precision: str = checked("32-true", one_of(*PRECISIONS))
    log_every_n_steps: int = checked(10, int_at_least(1))
    check_val_every_n_epoch: int = checked(1, int_at_least(1))
    limit_train_batches: Optional[int] = checked(None, optional(int_at_least(1)))
    enable_progress_bar: bool = checked(True, BOOL)
    num_threads: Optional[int] = checked(None, optional(int_at_least(1)))
    stochastic_length_alpha: Optional[float] = checked(None, optional(number_in(1.0, 2.0, open_low=True)))
    memory_check: bool = checked(True, BOOL)
    init_from: Optional[str] = checked(None, optional(NAME))
    track_rows: bool = checked(False, BOOL)
    publish_every: Any = checked(None, optional(PUBLISH_EVERY))
    publish_dir: Optional[str] = checked(None, optional(NAME))
    publish_base: Optional[str] = checked(None, optional(NAME))
    where: InitVar[str] = "trainer"

    def __post_init__(self, where: str) -> None:
        self.validate(where)


@dataclass(frozen=True)
class DistributedSection(Section):
    """dense_sharding: "none" (dense parameters replicated on every rank, gradients
    all-reduced by DDP) or "fsdp2" (the HSTU stack sharded over ranks with FSDP2, its
    parameters gathered per layer when used; tables are sharded by TorchRec either way)."""

    dense_sharding: str = checked("none", one_of(*DENSE_SHARDINGS))
    where: InitVar[str] = "distributed"

    def __post_init__(self, where: str) -> None:
        self.validate(where)


@dataclass(frozen=True)
class WarmStartSection(Section):
    """The recipe of a warm start (``trainer.init_from``), measured on ML-100K by
    ``bench/daily_retrain.py``; a run without ``init_from`` reads none of it. Each key but
    ``table_optimizer_state`` sets the key ``WARM_START_KEYS`` names (null: that key as the config
    says): ``replay`` data.replay (only with data.train_start), ``max_epochs`` trainer.max_epochs,
    ``early_stopping_patience`` trainer.early_stopping_patience, ``lr`` optimizer.lr (the dense
    learning rate), ``warmup_steps`` optimizer.warmup_steps (a re-warm of the dense learning rate),
    ``lr_decay`` / ``lr_floor`` optimizer.lr_decay / lr_floor (its decay over the warm run).
    ``replay_days``: replay only the last N days before data.train_start (sets data.replay_start
    to train_start - N days, when the run replays; null: every earlier event). ``validation_days``:
    with data.split time, the last N days before data.split_time validate instead of training (sets
    data.val_start), so the best epoch is judged on the new day (and early stopping can stop on it).
    ``table_optimizer_state``: "carry" the run's per-row table optimizer state for its rows, or
    "reset" it to zero; ``dense_optimizer_state``: "carry" the run's dense optimizer state (Adam's
    moments and step count) or start it "fresh"; ``shrink``: each carried weight (dense parameters
    and the run's table rows) starts at shrink x the run's value + (1 - shrink) x its fresh
    initialisation (1: the run's weights bit for bit; ``gr.train.warm_start``)."""

    replay: Optional[float] = checked(1.0, optional(number_in(0.0, 1.0)))
    max_epochs: Optional[int] = checked(10, optional(int_at_least(1)))
    early_stopping_patience: Optional[int] = checked(0, optional(int_at_least(0)))
    lr: Optional[float] = checked(None, optional(number_in(0.0, open_low=True)))
    warmup_steps: Optional[int] = checked(None, optional(int_at_least(0)))
    lr_decay: Optional[str] = checked(None, optional(one_of(*LR_DECAYS)))
    lr_floor: Optional[float] = checked(None, optional(number_in(0.0, 1.0)))
    replay_days: Optional[float] = checked(None, optional(number_in(0.0, open_low=True)))
    validation_days: Optional[float] = checked(None, optional(number_in(0.0, open_low=True)))
    table_optimizer_state: str = checked("reset", one_of(*TABLE_OPTIMIZER_STATES))
    dense_optimizer_state: str = checked("fresh", one_of(*DENSE_OPTIMIZER_STATES))
    shrink: float = checked(1.0, number_in(0.0, 1.0, open_low=True))
    where: InitVar[str] = "warm_start"

    def __post_init__(self, where: str) -> None:
        self.validate(where)


@dataclass(frozen=True)
class TrainConfig:
    data: DataConfig
    model: ModelSection
    sparse: SparseSection
    task: TaskSection
    optimizer: OptimizerSection
    trainer: TrainerSection
    distributed: DistributedSection = field(default_factory=DistributedSection)
    warm_start: WarmStartSection = field(default_factory=WarmStartSection)

    @property
    def task_type(self) -> str:
        return self.data.task

    @property
    def monitor(self) -> str:
        if self.trainer.monitor:
            return self.trainer.monitor
        return f"val/ndcg@{self.task.retrieval.top_k[0]}" if self.task_type == "retrieval" else "val/auc"

    def metric_names(self) -> Tuple[str, ...]:
        if self.task_type == "retrieval":
            return self.task.retrieval.metric_names()
        tasks = [t.name for t in self.data.ranking.tasks]
        return ("auc", "logloss", *(f"{m}/{t}" for t in tasks for m in ("auc", "logloss")))

    @classmethod
    def from_dict(cls, values: Any) -> "TrainConfig":
        values = known_keys(cls, values, "config")
        missing = [k for k in ("data", "model") if k not in values]
        if missing:
            raise ValueError(f"config: missing section(s) {missing}")
        data = DataConfig.from_dict(values["data"], "data")
        config = cls(
            data=data,
            model=ModelSection.from_dict(values["model"], "model", data.task),
            sparse=SparseSection.from_dict(values.get("sparse"), "sparse"),
            task=TaskSection.from_dict(values.get("task"), "task"),
            optimizer=OptimizerSection.from_dict(values.get("optimizer"), "optimizer"),
            trainer=TrainerSection.from_dict(values.get("trainer"), "trainer"),
            distributed=DistributedSection.from_dict(values.get("distributed"), "distributed"),
            warm_start=WarmStartSection.from_dict(values.get("warm_start"), "warm_start"),
        )
        config.check_consistency()
        config.model.check_classes("model")  # last: importing a class path runs its module's code
        return config

    def check_consistency(self) -> None:
        """Checks across sections."""
        if self.model.hstu.max_seq_len < self.data.max_seq_len:
            raise ValueError(
                f"model.hstu.max_seq_len: {self.model.hstu.max_seq_len} is below data.max_seq_len "
                f"{self.data.max_seq_len}; HSTU must fit the longest history"
            )
        if self.model.hstu.eviction_block > self.data.max_seq_len:
            raise ValueError(
                f"model.hstu.eviction_block: {self.model.hstu.eviction_block} exceeds data.max_seq_len "
                f"{self.data.max_seq_len}; a block must fit in a window"
            )
        t = self.trainer
        if (t.publish_every is None) != (t.publish_dir is None):
            given, missing = ("publish_every", "publish_dir")[:: 1 if t.publish_dir is None else -1]
            raise ValueError(f"trainer.{missing}: required with trainer.{given} (publishing needs how often and where)")
        if t.publish_base is not None and t.publish_every is None:
            raise ValueError("trainer.publish_base: set only with trainer.publish_every (the first delta's base)")
        if self.trainer.precision == "16-mixed" and self.trainer.accelerator not in GPU_ACCELERATORS:
            raise ValueError(
                f"trainer.precision: '16-mixed' (fp16 with loss scaling) needs trainer.accelerator "
                f"gpu; got accelerator {self.trainer.accelerator!r}. On CPU use 'bf16-mixed'"
            )
        if self.trainer.accelerator == "npu" and self.sparse.placement != "host":
            raise ValueError(
                f"sparse.placement: trainer.accelerator 'npu' needs 'host' (FBGEMM has no NPU embedding "
                f"kernels: tables in host memory, dense model on the NPU); got {self.sparse.placement!r}"
            )
        if self.sparse.backend != "torchrec":
            ranks = self.trainer.num_nodes * (self.trainer.devices if is_int(self.trainer.devices) else 1)
            if ranks > 1 or self.distributed.dense_sharding != "none":
                raise ValueError(
                    f"sparse.backend: {self.sparse.backend!r} trains on one rank; got trainer.devices "
                    f"{self.trainer.devices!r}, trainer.num_nodes {self.trainer.num_nodes}, distributed.dense_sharding "
                    f"{self.distributed.dense_sharding!r}. Use sparse.backend: torchrec to spread a run over ranks"
                )
        if self.distributed.dense_sharding == "fsdp2" and self.trainer.gradient_clip_val:
            raise ValueError(
                "trainer.gradient_clip_val: clipping by the global norm is not supported with "
                "distributed.dense_sharding 'fsdp2' (sharded and replicated gradients); set it to 0"
            )
        if not self.data.validates and self.trainer.early_stopping_patience:
            raise ValueError(
                "trainer.early_stopping_patience: data.split 'none' validates nothing to stop on (the run "
                f"trains trainer.max_epochs epochs); set it to 0 (got {self.trainer.early_stopping_patience})"
            )
        monitored = self.monitor.partition("/")[2]
        if not self.monitor.startswith("val/") or monitored not in self.metric_names():
            raise ValueError(
                f"trainer.monitor: expected 'val/<metric>' with a {self.task_type} metric "
                f"{list(self.metric_names())}, got {self.monitor!r}"
            )
        if self.task_type == "retrieval":
            item = self.task.retrieval.item_feature
            table = self.model.table_with(item)
            if table is None or table.get("kind", "sequence") != "sequence":
                raise ValueError(f"task.retrieval.item_feature: no sequence table in model.tables reads {item!r}")
        else:
            tasks = {t.name for t in self.data.ranking.tasks}
            unknown = sorted(set(self.task.ranking.task_weights) - tasks)
            if unknown:
                raise ValueError(f"task.ranking.task_weights: {unknown} are not data.ranking.tasks {sorted(tasks)}")

    def self_contained(self) -> "TrainConfig":
        """The config as a run records it, readable from any working directory: ``data.path`` and
        ``data.prepared`` absolute, ``model.code_path`` naming where its classes came from (``with_code_roots``)."""
        data, trainer = self.data, self.trainer
        if data.path is not None and not Path(data.path).is_absolute():
            data = replace(data, path=str(Path(data.path).resolve()))
        if data.prepared is not None and not Path(data.prepared).is_absolute():
            data = replace(data, prepared=str(Path(data.prepared).resolve()))
        paths: Dict[str, Any] = {
            key: str(Path(getattr(trainer, key)).resolve())
            for key in ("init_from", "publish_dir", "publish_base")
            if getattr(trainer, key) is not None
        }
        trainer = replace(trainer, **paths)
        return replace(self, data=data, trainer=trainer, model=self.model.with_code_roots())

    def to_dict(self) -> Dict[str, Any]:
        """Plain YAML-ready values; ``from_dict(to_dict())`` gives an equal config."""
        return plain(
            {
                "data": self.data.to_dict(),
                "model": self.model.to_dict(),
                "sparse": {**_fields(self.sparse), "optimizer": self.sparse.optimizer.to_dict()},
                "task": {"retrieval": _fields(self.task.retrieval), "ranking": _fields(self.task.ranking)},
                "optimizer": _fields(self.optimizer),
                "trainer": _fields(self.trainer),
                "distributed": _fields(self.distributed),
                "warm_start": _fields(self.warm_start),
            }
        )


def _fields(section: Any) -> Dict[str, Any]:
    return {f.name: getattr(section, f.name) for f in dataclasses.fields(section)}


def plain(value: Any) -> Any:
    """Tuples -> lists, recursively (YAML/JSON-safe)."""
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads ``1e-3`` as a string; read it (and ``5E+2``...) as a float, like YAML 1.2."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _timestamp(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> Any:
    """A YAML date or time, or its text when it is no real one (``2023-13-45``): the key's check
    then refuses it by name, saying what it expects."""
    try:
        return loader.construct_yaml_timestamp(node)
    except ValueError:
        return loader.construct_scalar(node)


_Loader.add_constructor("tag:yaml.org,2002:timestamp", _timestamp)


def read_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)


def parse_value(text: str) -> Any:
    """A command-line value read as YAML: ``3`` -> int, ``1e-3`` -> float, ``true`` -> bool, ``[1, 2]`` -> list."""
    return read_yaml(text) if text.strip() else text


def apply_override(values: Dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``values[a][b][c] = value`` for ``dotted = "a.b.c"``; list items by index (``tables.0.dim``).

    Missing mappings are created, so a misspelt key reaches validation, which names it.
    """
    parts = dotted.split(".")
    if not all(parts):
        raise ValueError(f"--{dotted}: expected a dotted config path like trainer.max_epochs")
    node: Any = values
    for depth, part in enumerate(parts[:-1]):
        where = ".".join(parts[: depth + 1])
        if isinstance(node, list):
            node = node[_list_index(node, part, where)]
        else:
            if node.get(part) is None:
                node[part] = {}
            node = node[part]
        if not isinstance(node, (dict, list)):
            raise ValueError(f"--{dotted}: {where} is a value ({node!r}), not a section")
    if isinstance(node, list):
        node[_list_index(node, parts[-1], dotted)] = value
    else:
        node[parts[-1]] = value


def _list_index(node: list, part: str, where: str) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise ValueError(f"--{where}: expected a list index below {len(node)}, got {part!r}")
    return int(part)


def read_recipe(path: str | Path, name: Optional[str] = None) -> Dict[str, Any]:
    """The sections of the recipe YAML at ``path``; a ValueError starting with ``name`` (default: the
    path) when it cannot be read, is not YAML or is not a mapping of sections."""
    name = str(path) if name is None else name
    try:
        values = read_yaml(Path(path).read_text(encoding="utf8"))
    except OSError as error:
        raise ValueError(f"{name}: cannot read the config ({error})") from error
    except yaml.YAMLError as error:
        raise ValueError(f"{name}: invalid YAML: {error}") from error
    if not isinstance(values, dict):
        raise ValueError(f"{name}: expected a mapping of sections (data:, model:, ...), got {type(values).__name__}")
    return values


def load_config(path: str | Path, overrides: Sequence[Tuple[str, str]] = ()) -> TrainConfig:
    """Read a recipe YAML, apply ``(dotted.key, text)`` overrides, validate. Errors name the file."""
    path = Path(path)
    values = read_recipe(path)
    for dotted, text in overrides:
        apply_override(values, dotted, parse_value(text))
    _check_path_is_read(values, path, overrides)
    try:
        apply_warm_start(values, {dotted for dotted, _ in overrides})
        return TrainConfig.from_dict(values)
    except ValueError as error:
        raise ValueError(f"{_source(path, str(error), overrides)}: {error}") from error


def apply_warm_start(values: Dict[str, Any], given: Collection[str]) -> None:
    """Under ``trainer.init_from``, set in ``values`` (a config's mapping, command-line overrides
    applied) each key a non-null ``warm_start`` key stands for (``WARM_START_KEYS``; data.replay only
    with data.train_start), over the config file's value; a key the command line gave (``given``:
    dotted keys) keeps it, and ``warm_start`` then records that value, so the run's config.yaml
    resolves alike on ``--resume``. Without ``init_from`` nothing changes."""
    trainer = values.get("trainer")
    if not isinstance(trainer, dict) or not trainer.get("init_from"):
        return
    recipe = WarmStartSection.from_dict(values.get("warm_start"), "warm_start")
    resolved = _fields(recipe)
    for key, target in WARM_START_KEYS.items():
        section_name, name = target.split(".")
        section = values.get(section_name)
        if section is None and section_name != "data":  # data is required: validation names it
            section = values[section_name] = {}
        if not isinstance(section, dict):
            continue  # validation names the section
        if target in given:
            resolved[key] = section[name]
        elif resolved[key] is not None and (key != "replay" or section.get("train_start") is not None):
            section[name] = resolved[key]
    data = values.get("data")
    if isinstance(data, dict):
        _apply_days(data, resolved, given, "replay_days", bool(data.get("replay")))
        _apply_days(data, resolved, given, "validation_days", data.get("split") == "time")
    values["warm_start"] = resolved


def _apply_days(
    data: Dict[str, Any], resolved: Dict[str, Any], given: Collection[str], key: str, applies: bool
) -> None:
    """The data time ``key`` (a warm_start key in days: ``WARM_START_DAYS``) stands for, that many
    days before the data time it counts from, when it ``applies``; that data key given on the
    command line wins (``key`` is then recorded as null, so a resume reads the given time)."""
    target, base = WARM_START_DAYS[key]
    if f"data.{target}" in given:
        resolved[key] = None
        return
    days = resolved[key]
    if days is None or not applies or data.get(base) is None:
        return
    seconds = iso_seconds(data[base])
    if is_int(seconds):  # anything else: the base key's own check names it
        data[target] = seconds - round(days * DAY_SECONDS)


def _check_path_is_read(values: Dict[str, Any], path: Path, overrides: Sequence[Tuple[str, str]]) -> None:
    """ValueError when the command line gives data.path but the config's data.prepared, which is
    streamed instead of the path, stays: the path would be silently unread."""
    given = dict(overrides)
    data = values.get("data")
    prepared = data.get("prepared") if isinstance(data, dict) else None
    if "data.path" in given and "data.prepared" not in given and prepared is not None:
        raise ValueError(
            f"--data.path {given['data.path']} (command line, over {path}): the config streams data.prepared "
            f"{prepared!r} instead of reading data.path; add --data.prepared null to read the path"
        )


def _source(path: Path, message: str, overrides: Sequence[Tuple[str, str]]) -> str:
    """Where the value a config error names came from: the command line's overrides of that key
    (or of a key inside it, or around it) over ``path``, else ``path``."""
    key = message.partition(":")[0]
    given = [
        f"--{dotted} {text}"
        for dotted, text in overrides
        if dotted == key or dotted.startswith(f"{key}.") or key.startswith(f"{dotted}.")
    ]
    return f"{' '.join(given)} (command line, over {path})" if given else str(path)


def save_config(config: TrainConfig, path: str | Path) -> None:
    """Write ``config`` as YAML (to a temporary file, then renamed over ``path``)."""
    write_text(path, config_yaml(config))


def config_yaml(config: TrainConfig) -> str:
    """The resolved config as YAML text (every key, defaults filled in)."""
    return yaml.safe_dump(config.to_dict(), sort_keys=False)
