"""A Parquet file with a corrupt data page: its footer (schema, row counts) reads, its values do not."""

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

FLIPPED = 16  # bytes of the page inverted


def write_corrupt_parquet(table: pa.Table, path: Path) -> Path:
    """Write ``table`` (snappy, plain encoding, one data page per column chunk), then invert 16 bytes
    in the middle of the data page of its largest column chunk, inside the compressed values."""
    pq.write_table(table, path, compression="snappy", use_dictionary=False)
    metadata = pq.ParquetFile(path).metadata.row_group(0)
    chunk = max((metadata.column(i) for i in range(metadata.num_columns)), key=lambda c: c.total_compressed_size)
    assert chunk.total_compressed_size > 4 * FLIPPED, "too small a page to corrupt inside its values"
    data = bytearray(path.read_bytes())
    middle = chunk.data_page_offset + chunk.total_compressed_size // 2
    for k in range(middle - FLIPPED // 2, middle + FLIPPED // 2):
        data[k] ^= 0xFF
    path.write_bytes(bytes(data))
    return path
