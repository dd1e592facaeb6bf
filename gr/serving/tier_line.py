"""Where fetching a user's encoded history from a tier costs less than encoding it, measured for the
model being served (``gr serve --tier-min-tokens auto``).

For history lengths L = ``FIRST_LENGTH``, 2 L, 4 L, ... up to the model's ``max_seq_len``, a
synthetic history of L tokens (random HSTU inputs, an event a minute) followed by ``NEW_TOKENS``
new ones is (a) encoded whole, and (b) fetched: its entry read back from the nearest tier (written
there beforehand under a version of its own, purged afterwards), unpacked (checks included) into
the engine's pages, and extended by the new tokens; each settled at a request's time in the pass
that encodes or extends it, as a request is (``CachedHSTU.encode_settled_batch``,
``extend_settled_batch``). Each is the fastest of ``REPS`` runs in this
thread's CPU time, which other processes and the server's other threads (a reload measures while
requests are served) barely skew; work torch spreads over other threads is not counted, which
favours encoding (long histories are the ones it spreads). The line is the shortest L at which (b) costs less than
(a) by ``MARGIN``: histories from there on are fetched, shorter ones encoded; with no such L up to
``max_seq_len`` (small models, whose passes cost little more than their fixed overhead), none is.

The PrefixDNN is left out of both (a fetched history embeds only its new tokens, an encoded one all
of them), so the line found is at or past the true one: a history fetched is never one that
encoding would have served faster.
"""

from __future__ import annotations

import copy
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import numpy as np
import torch

from gr.hstu.cache import CachedHSTU, cache_bytes_per_token
from gr.hstu.paged import PagePool
from gr.hstu.user_state import UserState
from gr.serving.shared_tier import TierStore, pack_state, unpack_state
from gr.timestamps import TIMESTAMPS

FIRST_LENGTH = 16
NEW_TOKENS = 4  # actions a request brings to its history
REPS = 5
STEP_S = 60  # seconds between the synthetic history's events
CALIBRATION_USER = "tier-line"
# How much less a fetch must cost than an encoding here: the probe reads one entry again and again,
# warm in the CPU's caches and in SQLite's, where under traffic an entry is cold and other workers'
# writes make the reader re-read the tier's index (the ML-1M recipe's shape: 0.2-0.3 ms a fetch
# here, 0.6-0.7 ms in bench/serving_tier.py's Zipf traffic).
MARGIN = 1.25


@dataclass(frozen=True)
class TierLine:
    """min_tokens: the shortest history fetched rather than encoded, or None (encoding always costs
    less); costs: per history length measured, (encode seconds, fetch and extend seconds);
    max_seq_len: the model's window."""

    min_tokens: Optional[int]
    costs: Dict[int, Tuple[float, float]]
    max_seq_len: int

    @property
    def tier_min_tokens(self) -> int:
        """The tiers' ``min_tokens`` that this line gives: past the window where none was found."""
        return self.max_seq_len + 1 if self.min_tokens is None else self.min_tokens

    def describe(self) -> str:
        """One log line: where the line is and the costs on either side of it."""
        costs = ", ".join(f"{n}: {1e3 * e:.2f}/{1e3 * f:.2f} ms" for n, (e, f) in sorted(self.costs.items()))
        where = "never" if self.min_tokens is None else f"from {self.min_tokens} tokens"
        return f"tier line: histories fetched {where} (encode/fetch+extend by history length: {costs})"


def first_cheaper(costs: Dict[int, Tuple[float, float]]) -> Optional[int]:
    """The shortest length whose fetch costs less than its encoding by ``MARGIN``, or None."""
    return next((n for n, (encode, fetch) in sorted(costs.items()) if fetch * MARGIN < encode), None)


def measure_tier_line(engine: CachedHSTU, tier: TierStore, page_size: int) -> TierLine:
    """The line for ``engine``'s HSTU, fetching through ``tier`` (module docstring). The engine's
    own pages and the tier's entries are left as they were: the measurement runs on a copy of the
    engine with a page pool of its own (``page_size`` tokens a page; 0: no pages) and purges what it
    wrote."""
    config = engine.config
    longest = config.max_seq_len - NEW_TOKENS
    probe = copy.copy(engine)
    room = 3 * config.max_seq_len * cache_bytes_per_token(config) + 2**20
    dtype = next(engine.hstu.parameters()).dtype
    probe.pool = PagePool.of_bytes(config, room, page_size, dtype=dtype, device=engine.device) if page_size else None
    version = f"{CALIBRATION_USER}-{uuid.uuid4().hex}"
    costs: Dict[int, Tuple[float, float]] = {}
    generator = torch.Generator().manual_seed(0)
    try:
        length = FIRST_LENGTH
        while length <= longest:
            costs[length] = _costs(probe, tier, version, length, generator)
            if first_cheaper(costs) is not None:
                break
            length *= 2
    finally:
        tier.purge(version)
    return TierLine(first_cheaper(costs), costs, config.max_seq_len)


def _costs(
    engine: CachedHSTU, tier: TierStore, version: str, length: int, generator: torch.Generator
) -> Tuple[float, float]:
    """(encode seconds, fetch and extend seconds) of a history of ``length`` tokens gaining ``NEW_TOKENS``."""
    total = length + NEW_TOKENS
    x = torch.randn(total, engine.config.hidden_dim, generator=generator).to(engine.device)
    times = torch.arange(total, dtype=torch.long) * STEP_S
    tokens = {"item": np.arange(total, dtype=np.int64), TIMESTAMPS: times.numpy()}
    [(cache, hidden)] = engine.encode_batch([x[:length]], [times[:length]])
    last = None if engine.defers_last else hidden[-1]  # what the entry of such a state carries
    state = UserState({k: v[:length] for k, v in tokens.items()}, cache, 0, last)
    tier.put(version, CALIBRATION_USER, pack_state(state, version, CALIBRATION_USER))
    del state, cache  # its pages back to the probe's pool

    request_time = [int(times[-1]) + STEP_S]

    def encode() -> None:
        engine.encode_settled_batch([x], [times], request_time)

    def fetch() -> None:
        blob = tier.get(version, CALIBRATION_USER)
        assert blob is not None  # written above
        fetched, reason = unpack_state(blob, version, CALIBRATION_USER, tokens, 0, engine)
        assert fetched is not None, reason  # the entry of this very history
        engine.extend_settled_batch([fetched.cache], [x[length:]], [times[length:]], request_time)

    return _fastest(encode), _fastest(fetch)


def _fastest(run: Callable[[], None]) -> float:
    """The fastest of ``REPS`` runs of ``run``, in this thread's CPU seconds (after one unmeasured run)."""
    run()
    best = float("inf")
    for _ in range(REPS):
        started = time.thread_time()
        run()
        best = min(best, time.thread_time() - started)
    return best
