"""The HSTU slice as another engine loads it: ``hstu/config.json`` and ``hstu/model.safetensors``.

``docs/hstu_slice.md`` is the contract: with these two files and that page an engine
reproduces the slice's outputs without gr. The config has Hugging Face-style keys
(``model_type: "hstu"``, ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``,
``max_position_embeddings``, ``torch_dtype``) plus HSTU's own (every other ``HSTUConfig``
field under its own name, and the derived ``alpha`` and ``time_bucket_log_divisor``). The
weights have one tensor per projection per layer (``layers.{i}.q_proj.weight`` ...), float32
or bfloat16. This module maps between those names and the ``HSTU`` module's state dict.
"""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
from torch import Tensor

from gr.export.format import FORMAT_VERSION, Problem
from gr.hstu.config import HSTUConfig
from gr.hstu.kernels.attention.common import TIME_BUCKET_LOG_DIV

MODEL_TYPE = "hstu"
SLICE_DTYPES: Dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16"}
# Hugging Face key -> HSTUConfig field; every other field keeps its own name.
HF_KEYS = {
    "hidden_size": "hidden_dim",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "max_position_embeddings": "max_seq_len",
}
DERIVED_KEYS = ("alpha", "time_bucket_log_divisor")
HEADER_KEYS = ("model_type", "torch_dtype", "format_version")
# HSTU module parameter -> slice tensor name (per layer, after "layers.{i}.")
_LAYER_NAMES = {
    "input_norm.weight": "input_layernorm.weight",
    "input_norm.bias": "input_layernorm.bias",
    "attn_norm.weight": "attn_layernorm.weight",
    "attn_norm.bias": "attn_layernorm.bias",
    "output.weight": "o_proj.weight",
    "output.bias": "o_proj.bias",
    "position_bias": "relative_position_bias",
    "time_bias": "relative_time_bias",
}
_UVQK = ("u_proj", "v_proj", "q_proj", "k_proj")  # the fused projection's row blocks, in order


def slice_config(config: HSTUConfig, dtype: str) -> Dict[str, Any]:
    """The ``hstu/config.json`` mapping of ``config`` with weights stored as ``dtype``."""
    values: Dict[str, Any] = {"model_type": MODEL_TYPE, "torch_dtype": dtype, "format_version": FORMAT_VERSION}
    ours = {v: k for k, v in HF_KEYS.items()}
    for f in fields(HSTUConfig):
        values[ours.get(f.name, f.name)] = getattr(config, f.name)
    values["alpha"] = config.alpha
    values["time_bucket_log_divisor"] = TIME_BUCKET_LOG_DIV
    return values


def config_from_slice(values: Any, rel: str, problems: List[Problem]) -> Optional[Tuple[HSTUConfig, str]]:
    """``hstu/config.json`` values -> (HSTUConfig, weight dtype); each bad key becomes a problem."""
    if not isinstance(values, Mapping):
        problems.append(Problem(rel, "-", f"expected a JSON object, got {type(values).__name__}"))
        return None
    start = len(problems)
    expected = {"model_type": MODEL_TYPE, "format_version": FORMAT_VERSION}
    for key, want in expected.items():
        if values.get(key) != want:
            problems.append(Problem(rel, key, f"expected {want!r}, got {values.get(key)!r}"))
    dtype = values.get("torch_dtype")
    if dtype not in SLICE_DTYPES:
        problems.append(Problem(rel, "torch_dtype", f"expected one of {list(SLICE_DTYPES)}, got {dtype!r}"))
    names = {**HF_KEYS, **{f.name: f.name for f in fields(HSTUConfig) if f.name not in HF_KEYS.values()}}
    for key in sorted(set(values) - set(names) - set(DERIVED_KEYS) - set(HEADER_KEYS)):
        problems.append(Problem(rel, key, "unknown key"))
    for key in sorted(set(names) - set(values)):
        problems.append(Problem(rel, key, "missing key"))
    if len(problems) > start:
        return None
    try:
        config = HSTUConfig.from_dict({field: values[key] for key, field in names.items()}, where=rel)
    except ValueError as exc:
        problems.append(Problem(rel, "-", str(exc)))
        return None
    derived = {"alpha": config.alpha, "time_bucket_log_divisor": TIME_BUCKET_LOG_DIV}
    for key, want in derived.items():
        got = values.get(key)
        if not isinstance(got, (int, float)) or not math.isclose(got, want, rel_tol=1e-12):
            problems.append(Problem(rel, key, f"expected {want!r} (derived from the other keys), got {got!r}"))
    return (config, str(dtype)) if len(problems) == start else None


def slice_tensor_shapes(config: HSTUConfig) -> Dict[str, Tuple[int, ...]]:
    """The tensor names and shapes of ``hstu/model.safetensors`` for ``config`` (docs/hstu_slice.md)."""
    d, h, da, dl = config.hidden_dim, config.num_heads, config.attention_dim, config.linear_dim
    shapes: Dict[str, Tuple[int, ...]] = {}
    if config.position_embedding:
        shapes["embed_positions.weight"] = (config.max_seq_len + 1, d)
    for i in range(config.num_layers):
        p = f"layers.{i}."
        shapes.update({p + "input_layernorm.weight": (d,), p + "input_layernorm.bias": (d,)})
        for name, rows in zip(_UVQK, (h * dl, h * dl, h * da, h * da)):
            shapes.update({p + name + ".weight": (rows, d), p + name + ".bias": (rows,)})
        shapes.update(
            {
                p + "attn_layernorm.weight": (h * dl,),
                p + "attn_layernorm.bias": (h * dl,),
                p + "o_proj.weight": (d, h * dl),
                p + "o_proj.bias": (d,),
            }
        )
        if config.num_position_buckets > 0:
            shapes[p + "relative_position_bias"] = (config.num_position_buckets,)
        if config.time_buckets > 0:
            shapes[p + "relative_time_bias"] = (config.time_buckets,)
    return shapes


def to_slice(state: Mapping[str, Tensor], config: HSTUConfig, dtype: str) -> Dict[str, Tensor]:
    """``HSTU.state_dict()`` -> the slice's tensors (names of ``slice_tensor_shapes``), as ``dtype``."""
    out: Dict[str, Tensor] = {}
    split = _uvqk_rows(config)
    for name, tensor in state.items():
        tensor = tensor.detach().to(SLICE_DTYPES[dtype])
        if name == "position_embedding.weight":
            out["embed_positions.weight"] = tensor
            continue
        layer, _, rest = name.partition(".")[2].partition(".")
        p = f"layers.{layer}."
        if rest.startswith("uvqk."):
            for part, block in zip(_UVQK, torch.split(tensor, split, dim=0)):
                out[p + part + rest[len("uvqk") :]] = block
        else:
            out[p + _LAYER_NAMES[rest]] = tensor
    return {name: t.contiguous() for name, t in out.items()}


def from_slice(tensors: Mapping[str, Tensor], config: HSTUConfig) -> Dict[str, Tensor]:
    """The slice's tensors -> an ``HSTU`` state dict (float32), the inverse of ``to_slice``."""
    state: Dict[str, Tensor] = {}
    if config.position_embedding:
        state["position_embedding.weight"] = tensors["embed_positions.weight"]
    for i in range(config.num_layers):
        p = f"layers.{i}."
        for ours, theirs in _LAYER_NAMES.items():
            if p + theirs in tensors:
                state[p + ours] = tensors[p + theirs]
        for kind in ("weight", "bias"):
            state[p + "uvqk." + kind] = torch.cat([tensors[f"{p}{part}.{kind}"] for part in _UVQK])
    return {name: t.to(torch.float32) for name, t in state.items()}


def _uvqk_rows(config: HSTUConfig) -> List[int]:
    h = config.num_heads
    return [h * config.linear_dim, h * config.linear_dim, h * config.attention_dim, h * config.attention_dim]
