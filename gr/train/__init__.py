"""Training: config, model building, the Lightning loop over the sparse tables (TorchRec or torch), checkpoints.

Entry points: ``train(config, out_dir, resume=False)`` (what ``train.py`` runs),
``load_config(path, overrides)``, ``load_trained_model(run_dir) -> (GRModel, TrainConfig)``.

A run directory holds:

    config.yaml        the resolved config actually used (table rows filled in from the data);
                       ``load_config`` reads it back
    features.json      what the data provided ({"spec": FeatureSpec fields, "tasks": [...]}),
                       so the model can be rebuilt without reading the data
    metrics.json       test metrics of the best checkpoint ("hr@10", "ndcg@10", ..., "mrr" for
                       retrieval with "popularity": the most-popular baseline by the same code;
                       "auc", "logloss", "auc/<task>", "logloss/<task>" for ranking), plus
                       "best_val", "best_checkpoint", "epochs", "world_size",
                       "table_rows_per_rank", "data" (rows read, duplicates dropped or
                       kept, users, items, interactions), "config", and a warm start's "init_from"
    init_from.json     a warm start only (``--init-from``): the run and checkpoint it began from, that
                       checkpoint's epoch and step, and the ids the new data added per map ("new_ids")
    mappings/          raw <-> dense id mappings (``SequenceDataModule.save_mappings``)
    popularity.safetensors  each item's count in the training data (``gr.data.popularity``)
    checkpoints/       DCP checkpoint directories: "epoch=N" (the best by trainer.monitor; N counted
                       from 0, where the progress bar and lines count from 1)
                       and "last" (for --resume); each has every rank's shards + meta.pt
    logs/              TensorBoard events and metrics.csv (Lightning's CSV logger)
    .lock              only while a process trains, resumes or exports the run (``gr.utils.run_lock``)

Public names load lazily, so reading a config does not import Lightning.
"""

from gr.utils.lazy import lazy_getattr

_EXPORTS = {
    "TrainConfig": "gr.train.config",
    "load_config": "gr.train.config",
    "train": "gr.train.run",
    "load_trained_model": "gr.train.run",
    "read_run": "gr.train.run",
    "build_model": "gr.train.build",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
