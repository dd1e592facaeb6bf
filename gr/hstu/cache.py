"""Prefix (KV) caching for HSTU serving: encode a history once, then extend it or score candidates.

HSTU history is causal and the attention normaliser is constant or per-position, so
a history token's keys and values never change when tokens are appended; target
tokens see the history and themselves only. A cached history therefore lets a new
token (history or candidate) be computed from its own projections plus the cached
per-layer K and V, with results equal to the one-pass ``HSTU.forward``.

With ``HSTUConfig.query_time == "next_event"`` a history token's output depends on the time
of the event after it, which for the last history token is the request's time. That token
stays *pending* in the cache (only its input is kept) until the next event arrives
(``extend``) or a request settles it (``score``, ``settle``): one token recomputed per request.

Imports only torch, gr.hstu and gr.jagged: the serving runtime uses it without the
training code.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from gr.hstu.config import HSTUConfig
from gr.hstu.kernels.common import hstu_visibility, position_bucket, silu_norm, time_bucket
from gr.hstu.layer import HSTULayer
from gr.hstu.stack import HSTU

TIMESTAMP_BYTES = 8  # one int64 timestamp per cached token


@dataclass(frozen=True)
class HistoryCache:
    """One user's encoded history; immutable, so concurrent readers can share it.

    keys: per layer [H, C, Da] float, values: per layer [H, C, Dl] float: the C committed tokens
    timestamps: [L] int64 seconds of all L history tokens
    pending: [L - C, D] float or None: the input (PrefixDNN output) of the last history tokens,
        whose outputs wait for the time of the event after them ("next_event" query time)
    """

    keys: Tuple[Tensor, ...]
    values: Tuple[Tensor, ...]
    timestamps: Tensor
    pending: Optional[Tensor] = None

    @property
    def length(self) -> int:
        """History tokens, pending ones included."""
        return int(self.timestamps.numel())

    @property
    def committed(self) -> int:
        """History tokens whose K/V are cached."""
        return self.length - (0 if self.pending is None else int(self.pending.shape[0]))

    @property
    def nbytes(self) -> int:
        tensors = (*self.keys, *self.values, self.timestamps, *(() if self.pending is None else (self.pending,)))
        return sum(t.numel() * t.element_size() for t in tensors)


def cache_bytes_per_token(config: HSTUConfig, dtype: torch.dtype = torch.float32) -> int:
    """Bytes a ``HistoryCache`` holds per history token: K and V of every layer, plus its timestamp."""
    element = torch.empty(0, dtype=dtype).element_size()
    per_layer = config.num_heads * (config.attention_dim + config.linear_dim) * element
    return config.num_layers * per_layer + TIMESTAMP_BYTES


def attend_cached(
    layer: HSTULayer,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    query_positions: Tensor,
    cache_keys: Tensor,
    cache_values: Tensor,
    cache_visible: Tensor,
    block_visible: Optional[Tensor],
    cache_buckets: "BiasBuckets",
    block_buckets: Optional["BiasBuckets"],
) -> Tensor:
    """HSTU attention of n new tokens over L cached history tokens and the new block itself.

    q, k: [n, H, Da] float, v: [n, H, Dl] float: the new tokens' projections
    query_positions: [n] int64 position of each new token (a target's is the history length)
    cache_keys: [H, L, Da] float, cache_values: [H, L, Dl] float; cached key j has position j
    cache_visible: [n, L] or [1, L] bool, whether new token i sees cached token j
    block_visible: [n, n] bool, whether new token i sees new token j; None -> itself only
        (then each query's time is its own timestamp: the self term has time delta 0)
    cache_buckets, block_buckets: the bias buckets of (new, cached) and (new, new) pairs
        (``BiasBuckets``; computed once per pass, shared by the layers); block_buckets is
        needed when block_visible is given
    returns: [n, H, Dl], equal to the rows of the one-pass attention for these tokens
    """
    norm = silu_norm(query_positions, layer.silu_scale()).to(q.dtype).view(1, -1, 1)  # [1, n, 1]
    qh = (q * layer.config.alpha).transpose(0, 1)  # [H, n, Da]
    kh, vh = k.transpose(0, 1), v.transpose(0, 1)
    logits = torch.matmul(qh, cache_keys.transpose(1, 2))  # [H, n, L]
    bias = cache_buckets.bias(layer)
    if bias is not None:
        logits.add_(bias)
    scores = F.silu(logits, inplace=True)
    if not bool(cache_visible.all()):
        scores.mul_(cache_visible.to(scores.dtype))
    out = torch.matmul(scores, cache_values)  # [H, n, Dl]
    if block_visible is None:
        self_logits = (qh * kh).sum(-1)  # [H, n]
        origin = torch.zeros(1, dtype=torch.long, device=q.device)
        # [1, 1]: distance 0, time delta 0
        self_bias = BiasBuckets.between(layer.config, origin, origin, origin, origin).bias(layer)
        if self_bias is not None:
            self_logits = self_logits + self_bias
        out = out + F.silu(self_logits).unsqueeze(-1) * vh
    else:
        block_logits = torch.matmul(qh, kh.transpose(1, 2))  # [H, n, n]
        block_bias = block_buckets.bias(layer)
        if block_bias is not None:
            block_logits = block_logits + block_bias
        out = out + torch.matmul(F.silu(block_logits) * block_visible.to(q.dtype), vh)
    return (out * norm).transpose(0, 1)  # the per-query norm, applied after the sums


def _all_equal(values: Tensor) -> bool:
    return values.numel() <= 1 or bool((values == values[0]).all())


@dataclass(frozen=True)
class BiasBuckets:
    """Bucket indices of the relative bias between n queries and K keys; every layer of a pass
    shares them (only the bias tables differ per layer).

    position: [n, K] int64 or None (position bias off); time: [n, K] int64 or None (time bias off)
    Either may have 1 row, broadcast over every query.
    """

    position: Optional[Tensor]
    time: Optional[Tensor]

    @classmethod
    def between(
        cls,
        config: HSTUConfig,
        query_positions: Tensor,
        query_times: Optional[Tensor],
        key_positions: Tensor,
        key_timestamps: Optional[Tensor],
    ) -> "BiasBuckets":
        """query_positions: [n] int64, query_times: [n] int64 or None;
        key_positions: [K] int64, key_timestamps: [K] int64 or None."""
        position = time = None
        if config.num_position_buckets > 0:
            rel = query_positions.view(-1, 1) - key_positions.view(1, -1)
            position = position_bucket(rel, config.num_position_buckets)
        if config.time_buckets > 0:
            if query_times is None or key_timestamps is None:
                raise ValueError("HSTU cache: timestamps are required when HSTUConfig.time_buckets > 0")
            delta = query_times.view(-1, 1) - key_timestamps.view(1, -1)
            time = time_bucket(delta, config.time_bucketing, config.time_buckets)
        return cls(position, time)

    @classmethod
    def for_cache(
        cls,
        config: HSTUConfig,
        query_positions: Tensor,
        query_times: Optional[Tensor],
        cache_timestamps: Optional[Tensor],
        cache_length: int,
    ) -> "BiasBuckets":
        """The buckets of new tokens against cached tokens 0..cache_length-1 (cached key j has position j).

        Every row is the same when the new tokens share position and timestamp (candidates of one
        request): computed once, broadcast over the rows.
        """
        rows = 1 if _all_equal(query_positions) and (query_times is None or _all_equal(query_times)) else None
        cache_positions = torch.arange(cache_length, device=query_positions.device)
        query_times = None if query_times is None else query_times[:rows]
        return cls.between(config, query_positions[:rows], query_times, cache_positions, cache_timestamps)

    def bias(self, layer: HSTULayer) -> Optional[Tensor]:
        """The layer's [n, K] bias (position and time parts, each when on), or None when both are off."""
        bias = None
        if self.position is not None and layer.position_bias is not None:
            bias = layer.position_bias[self.position]
        if self.time is not None and layer.time_bias is not None:
            part = layer.time_bias[self.time]
            bias = part if bias is None else bias + part
        return bias


class CachedHSTU:
    """Inference engine over a trained ``HSTU``: encode, extend and score with a ``HistoryCache``.

    ``score`` after ``encode(history)`` equals ``HSTU.forward`` on history + candidates
    with ``num_targets`` (candidates at position L, timestamps as given; with "next_event"
    query times, the last history token's query time is ``request_time``); ``extend`` equals
    encoding the longer history in one pass.
    """

    def __init__(self, hstu: HSTU) -> None:
        if not isinstance(hstu, HSTU):
            raise TypeError(f"CachedHSTU: expected an HSTU module, got {type(hstu).__name__}")
        self.hstu = hstu.eval()
        self.config = hstu.config
        # whether the last history token's output waits for the time of the event after it
        self.defers_last = hstu.config.query_time == "next_event" and hstu.config.time_buckets > 0

    def can_extend(self, cache: HistoryCache) -> bool:
        """False while the history is shorter than contextual_len: contextual tokens see each
        other in both directions, so such a history must be re-encoded, not extended."""
        return cache.length >= self.config.contextual_len

    @torch.inference_mode()
    def encode(self, x: Tensor, timestamps: Optional[Tensor]) -> HistoryCache:
        """x: [L, D] float PrefixDNN output of the history; timestamps: [L] int64 -> cache
        (the last token pending when the engine ``defers_last``)."""
        length = self._check_tokens(x, timestamps, start=0)
        ts = self._timestamps(timestamps, length, x.device)
        committed = length - 1 if self.defers_last and length else length
        keys, values = [], []
        if committed:
            positions = torch.arange(committed, device=x.device)
            h = self.hstu.embed(x[:committed], positions)
            offsets = torch.tensor([0, committed], device=x.device)
            query_ts = ts[1:] if self.defers_last else None
            for layer in self.hstu.layers:
                u, q, k, v = layer.project(h)
                attn = layer.attend(q, k, v, offsets, committed, ts[:committed], query_times=query_ts)
                h = layer.combine(h, attn, u)
                keys.append(k.transpose(0, 1).contiguous())
                values.append(v.transpose(0, 1).contiguous())
        else:
            keys, values = self._empty_kv(x)
        return HistoryCache(tuple(keys), tuple(values), ts, x[committed:] if committed < length else None)

    @torch.inference_mode()
    def extend(self, cache: HistoryCache, x: Tensor, timestamps: Optional[Tensor]) -> HistoryCache:
        """Append n history tokens, computing only them (and the pending one, whose next event
        they bring). x: [n, D] float; timestamps: [n] int64."""
        if not self.can_extend(cache):
            raise ValueError(
                f"HSTU cache: a history of {cache.length} tokens is shorter than HSTUConfig.contextual_len "
                f"{self.config.contextual_len}; encode the whole history instead"
            )
        n = self._check_tokens(x, timestamps, start=cache.length)
        if n == 0:
            return cache
        tokens = x if cache.pending is None else torch.cat([cache.pending, x])
        ts = torch.cat([cache.timestamps, self._timestamps(timestamps, n, x.device)])
        run = tokens.shape[0] - 1 if self.defers_last else tokens.shape[0]
        keys, values, _ = self._commit(cache, tokens[:run], ts[cache.committed :], ts.numel())
        return HistoryCache(keys, values, ts, tokens[run:] if run < tokens.shape[0] else None)

    @torch.inference_mode()
    def settle(self, cache: HistoryCache, request_time: Optional[int]) -> Tuple[HistoryCache, Tensor]:
        """Commit the pending history tokens, the request being the event after the last one.

        -> (a cache with nothing pending, the settled tokens' HSTU outputs [p, D])
        request_time: seconds; needed only when something is pending
        """
        if cache.pending is None:
            return cache, cache.timestamps.new_zeros(0, self.config.hidden_dim, dtype=torch.float32)
        if request_time is None:
            raise ValueError("HSTU cache: request_time is required: the last history token's output depends on "
                             "the time of the request (HSTUConfig.query_time is 'next_event')")
        request = torch.tensor([int(request_time)], dtype=torch.long, device=cache.timestamps.device)
        keys, values, hidden = self._commit(cache, cache.pending,
                                            torch.cat([cache.timestamps[cache.committed :], request]), cache.length)
        return HistoryCache(keys, values, cache.timestamps), hidden

    @torch.inference_mode()
    def score(self, cache: HistoryCache, x: Tensor, timestamps: Optional[Tensor], micro_batch: int = 256,
              request_time: Optional[int] = None) -> Tensor:
        """HSTU outputs of N candidate tokens against the cached history.

        x: [N, D] float PrefixDNN output of the candidates; timestamps: [N] int64 (request time)
        micro_batch: candidates per pass; the result does not depend on it
        request_time: seconds, needed when the cache has a pending token (see ``settle``)
        returns: [N, D]
        """
        if micro_batch < 1:
            raise ValueError(f"micro_batch: expected >= 1, got {micro_batch}")
        self._check_tokens(x, timestamps, start=cache.length, targets=True)
        cache = self.settle(cache, request_time)[0]
        length = cache.length
        history_len = torch.tensor(length, device=x.device)
        history_cols = torch.arange(length, device=x.device).view(1, -1)
        cache_visible = self._visible(history_len.view(1, 1), history_cols, history_len)
        outputs = []
        for start in range(0, x.shape[0], micro_batch):
            chunk = x[start : start + micro_batch]
            ts = None if timestamps is None else timestamps[start : start + micro_batch]
            positions = torch.full((chunk.shape[0],), length, dtype=torch.long, device=x.device)
            h, _, _ = self._run_new_tokens(cache, chunk, positions, ts, cache_visible, None)
            outputs.append(h)
        return torch.cat(outputs) if outputs else x.new_zeros(0, self.config.hidden_dim)

    @torch.inference_mode()
    def run_block(
        self,
        cache: HistoryCache,
        x: Tensor,
        timestamps: Optional[Tensor],
        depths: Tensor,
        block_visible: Tensor,
    ) -> Tuple[Tensor, List[Tensor], List[Tensor]]:
        """Run a block of n new history tokens after the cache without committing them (e.g. a draft
        token tree: branches causal, invisible to each other). Each token's query time is its own
        timestamp (generated tokens: the event after them is generated at the same request time).

        x: [n, D] float PrefixDNN output; timestamps: [n] int64
        depths: [n] int64 >= 1, token i sits at position cache.length + depths[i] - 1
        block_visible: [n, n] bool, whether new token i sees new token j (the diagonal must be set)
        returns: (outputs [n, D], per-layer keys [H, n, Da], per-layer values [H, n, Dl]); a token
        whose visible block tokens are exactly its predecessors at depths 1..d-1 gets the outputs
        and K/V that ``extend`` with that chain would compute
        """
        if cache.pending is not None:
            raise ValueError("HSTU cache: the history has a pending token; settle(cache, request_time) first")
        n = self._check_tokens(x, timestamps, start=cache.length, targets=True)
        if depths.shape != (n,) or block_visible.shape != (n, n):
            raise ValueError(f"HSTU cache: depths must be [{n}] and block_visible [{n}, {n}], "
                             f"got {tuple(depths.shape)} and {tuple(block_visible.shape)}")
        if n and (int(depths.min()) < 1 or cache.length + int(depths.max()) > self.config.max_seq_len):
            raise ValueError(f"HSTU cache: depths must lie in [1, {self.config.max_seq_len - cache.length}]")
        if not self.can_extend(cache):
            raise ValueError(f"HSTU cache: a history of {cache.length} tokens is shorter than "
                             f"HSTUConfig.contextual_len {self.config.contextual_len}; encode it instead")
        positions = cache.length + depths.to(torch.long) - 1
        history_len = torch.tensor(cache.length + n, device=x.device)
        cache_cols = torch.arange(cache.length, device=x.device)
        cache_visible = self._visible(positions.view(-1, 1), cache_cols.view(1, -1), history_len)
        window = self._visible(positions.view(-1, 1), positions.view(1, -1), history_len) | torch.eye(
            n, dtype=torch.bool, device=x.device)
        return self._run_new_tokens(cache, x, positions, timestamps, cache_visible, block_visible & window)

    def _commit(
        self, cache: HistoryCache, x: Tensor, times: Tensor, history_len: int
    ) -> Tuple[Tuple[Tensor, ...], Tuple[Tensor, ...], Tensor]:
        """Run history tokens right after the committed ones as a causal chain.

        x: [n, D] float; times: [n] int64 their timestamps, or [n + 1] when the engine defers
        the last token (then times[i + 1] is token i's query time); history_len: tokens in the
        whole history -> (per-layer keys and values of the committed tokens and these, outputs [n, D])
        """
        n, start = x.shape[0], cache.committed
        if n == 0:
            return cache.keys, cache.values, x.new_zeros(0, self.config.hidden_dim)
        index = torch.arange(start, start + n, device=x.device)
        length = torch.tensor(history_len, device=x.device)
        cache_visible = self._visible(index.view(-1, 1), torch.arange(start, device=x.device).view(1, -1), length)
        block_visible = self._visible(index.view(-1, 1), index.view(1, -1), length)
        committed = HistoryCache(cache.keys, cache.values, cache.timestamps[:start])
        hidden, keys, values = self._run_new_tokens(committed, x, index, times[:n], cache_visible, block_visible,
                                                    times[1:] if self.defers_last else None)
        keys = tuple(torch.cat([old, new], dim=1) for old, new in zip(cache.keys, keys))
        values = tuple(torch.cat([old, new], dim=1) for old, new in zip(cache.values, values))
        return keys, values, hidden

    def _run_new_tokens(
        self,
        cache: HistoryCache,
        x: Tensor,
        positions: Tensor,
        timestamps: Optional[Tensor],
        cache_visible: Tensor,
        block_visible: Optional[Tensor],
        query_times: Optional[Tensor] = None,
    ) -> Tuple[Tensor, List[Tensor], List[Tensor]]:
        """New tokens through every layer against a cache with nothing pending (see ``attend_cached``).

        query_times: [n] int64, each token's query time; None -> its own timestamp
        -> (outputs [n, D], per-layer keys [H, n, Da], per-layer values [H, n, Dl])
        """
        query_ts = timestamps if query_times is None else query_times
        h = self.hstu.embed(x, positions)
        cache_buckets = BiasBuckets.for_cache(self.config, positions, query_ts, cache.timestamps, cache.length)
        block_buckets = None if block_visible is None else BiasBuckets.between(
            self.config, positions, query_ts, positions, timestamps)
        keys, values = [], []
        for i, layer in enumerate(self.hstu.layers):
            u, q, k, v = layer.project(h)
            attn = attend_cached(layer, q, k, v, positions, cache.keys[i], cache.values[i], cache_visible,
                                 block_visible, cache_buckets, block_buckets)
            h = layer.combine(h, attn, u)
            keys.append(k.transpose(0, 1))
            values.append(v.transpose(0, 1))
        return h, keys, values

    def _empty_kv(self, x: Tensor) -> Tuple[List[Tensor], List[Tensor]]:
        c = self.config
        keys = [x.new_zeros(c.num_heads, 0, c.attention_dim) for _ in range(c.num_layers)]
        values = [x.new_zeros(c.num_heads, 0, c.linear_dim) for _ in range(c.num_layers)]
        return keys, values

    def _visible(self, row: Tensor, col: Tensor, history_len: Tensor) -> Tensor:
        big = torch.tensor(torch.iinfo(torch.int64).max, device=row.device)
        return hstu_visibility(row, col, big, history_len, self.config.contextual_len, self.config.max_attn_len)

    def _timestamps(self, timestamps: Optional[Tensor], count: int, device: torch.device) -> Tensor:
        if timestamps is None:
            return torch.zeros(count, dtype=torch.long, device=device)
        return timestamps.to(torch.long)

    def _check_tokens(self, x: Tensor, timestamps: Optional[Tensor], start: int, targets: bool = False) -> int:
        """Validate a block of new tokens at ``start``; returns its token count."""
        c = self.config
        if x.dim() != 2 or x.shape[1] != c.hidden_dim:
            raise ValueError(f"HSTU cache: x must be [n, {c.hidden_dim}], got {tuple(x.shape)}")
        if timestamps is None and c.time_buckets > 0:
            raise ValueError("HSTU cache: timestamps are required when HSTUConfig.time_buckets > 0")
        if timestamps is not None and timestamps.shape != x.shape[:1]:
            raise ValueError(f"HSTU cache: timestamps must be [{x.shape[0]}], got {tuple(timestamps.shape)}")
        history_end = start if targets else start + x.shape[0]
        if history_end > c.max_seq_len:
            raise ValueError(
                f"HSTU cache: a history of {history_end} tokens exceeds HSTUConfig.max_seq_len {c.max_seq_len}"
            )
        return int(x.shape[0])
