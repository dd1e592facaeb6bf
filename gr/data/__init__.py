"""Datasets for gr: public-format readers, the synthetic generator, leave-one-out splits, batching.

Public names load lazily, so reading files does not import torch or Lightning.
"""

from gr.utils.lazy import lazy_getattr

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

__getattr__ = lazy_getattr(__name__, _EXPORTS)
