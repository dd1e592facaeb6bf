"""The names of a run directory's files and directories (``gr.train`` describes each), without the
training stack: the commands name them before they import it."""

CONFIG_FILE = "config.yaml"
FEATURES_FILE = "features.json"
METRICS_FILE = "metrics.json"
INIT_FROM_FILE = "init_from.json"  # a warm-started run: the checkpoint it began from and the ids it added
MAPPINGS_DIR = "mappings"
CHECKPOINTS_DIR = "checkpoints"
LOGS_DIR = "logs"
LAST_CHECKPOINT = "last"
