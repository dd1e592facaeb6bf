"""Prepared sequence datasets: per-user sequences written once by an engine (``gr data prepare``),
streamed shard by shard by each training rank. ``gr.data.prepared.manifest`` defines the format.
"""
