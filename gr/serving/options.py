"""The serving runtime's options with their choices and defaults (``Ranker``, ``ServingModel``, requests,
``gr serve`` / ``rank`` / ``recommend`` / ``generate`` / ``predict``), without the runtime: the commands
build their parsers from them before torch and ONNX Runtime are imported."""

ID_SPACES = ("raw", "model")  # a request's ids: raw (through the export's id maps) or model (table rows)
UNKNOWN_IDS = ("error", "oov")  # an unknown raw id: a RequestError, or the map's out-of-vocabulary row
LONG_HISTORY = ("truncate", "refuse")  # a history longer than max_seq_len: its most recent tokens, or an error
INDEXES = ("exact", "hnsw")  # the catalogue's item index, each a class in gr.serving.catalogue
DEFAULT_CACHE_BYTES = 256 * 2**20  # the user cache's budget
DEFAULT_PAGE_SIZE = 16  # tokens per page of the cached histories' K/V (gr.hstu.paged.PagePool)
DEFAULT_MICRO_BATCH = 256  # candidates per HSTU pass
DEFAULT_TIER_BYTES = 0  # the shared tier of a server's workers (gr.serving.shared_tier; 0: off)
DEFAULT_TIER_MIN_TOKENS = 64  # shorter histories are encoded, never fetched from a tier (bench/serving_tier.py)
