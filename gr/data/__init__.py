"""Datasets for gr: public-format readers, the synthetic generator, leave-one-out splits, batching.

Public names load lazily, so reading files does not import torch or Lightning.
"""
from importlib import import_module
from typing import Any

_EXPORTS = {
    "DataConfig": "gr.data.config",
    "DataFormatError": "gr.data.interactions",
    "FeatureSpec": "gr.data.features",
    "IdMap": "gr.data.mappings",
    "Interactions": "gr.data.interactions",
    "READERS": "gr.data.readers",
    "SequenceDataModule": "gr.data.datamodule",
    "build_sequences": "gr.data.sequences",
    "generate_synthetic": "gr.data.synthetic",
    "load_mappings": "gr.data.mappings",
    "read_source": "gr.data.readers",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'gr.data' has no attribute {name!r}")
