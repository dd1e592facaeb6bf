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

Attention runs through ``gr.hstu.kernels.cached_attention.hstu_cached_attention`` (the layer's backend), so
serving reaches the same CPU fast path, Triton and Ascend kernels as training. Several users'
histories and caches run in one pass (``encode_batch``, ``extend_batch``, ``score_batch``,
``commit_batch``). The engine runs where the HSTU's
parameters are (``CachedHSTU.device``): new tokens and timestamps are moved there, and every
cache tensor lives there. Imports only torch, gr.hstu and gr.jagged: the serving runtime uses it
without the training code.

With a ``PagePool`` (``CachedHSTU.pool``, ``gr.hstu.paged``) the committed K/V live in the pool's
pages: encoding writes them there, extending appends the new tokens' K/V to the history's pages
(no copy of the prefix) and attention reads them through the page tables. A history the pool
cannot hold stays in its own tensors, as without a pool; both give the same results, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple, cast

import torch
from torch import Tensor

from gr.hstu.config import HSTUConfig
from gr.hstu.kernels.attention import AttentionWorkspace
from gr.hstu.kernels.cached_attention import CachedSetup, CacheTensor, PagedCache, PageTables, default_positions
from gr.hstu.layer import HSTULayer
from gr.hstu.paged import PagedKV, PagePool
from gr.hstu.stack import HSTU
from gr.jagged import offsets_from_lengths

TIMESTAMP_BYTES = 8  # one int64 timestamp per cached token


@dataclass(frozen=True)
class HistoryCache:
    """One user's encoded history; immutable, so concurrent readers can share it.

    keys: per layer [H, C, Da] float, values: per layer [H, C, Dl] float: the C committed tokens
        (empty tuples when ``paged`` holds them)
    timestamps: [L] int64 seconds of all L history tokens
    pending: [L - C, D] float or None: the input (PrefixDNN output) of the last history tokens,
        whose outputs wait for the time of the event after them ("next_event" query time)
    paged: the committed tokens' K/V in a ``PagePool`` (``gr.hstu.paged``), or None
    """

    keys: Tuple[Tensor, ...]
    values: Tuple[Tensor, ...]
    timestamps: Tensor
    pending: Optional[Tensor] = None
    paged: Optional[PagedKV] = None

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
        """Bytes it holds: its K/V tensors or pages, timestamps and pending inputs."""
        tensors = (*self.keys, *self.values, self.timestamps, *(() if self.pending is None else (self.pending,)))
        return sum(t.numel() * t.element_size() for t in tensors) + (0 if self.paged is None else self.paged.nbytes)

    def layer(self, index: int) -> Tuple[Tensor, Tensor]:
        """Layer ``index``'s committed (K [H, C, Da], V [H, C, Dl]), read through the page table when paged."""
        if self.paged is not None:
            return self.paged.layer(index)
        return self.keys[index], self.values[index]

    def unpaged(self) -> "HistoryCache":
        """The same cache with its K/V in its own tensors (a copy of the pages when paged: never a view
        of the pool, whose pages may be reused once this cache's ``paged`` is gone)."""
        if self.paged is None:
            return self
        layers = [self.layer(i) for i in range(len(self.paged.pool.keys))]
        return HistoryCache(
            tuple(_own(k) for k, _ in layers), tuple(_own(v) for _, v in layers), self.timestamps, self.pending
        )


def _own(read: Tensor) -> Tensor:
    """A paged read in a tensor of its own: a view of the pool copied, a gather (already a copy) kept."""
    return read.clone(memory_format=torch.contiguous_format) if read._base is not None else read


def cache_bytes_per_token(config: HSTUConfig, dtype: torch.dtype = torch.float32) -> int:
    """Bytes a ``HistoryCache`` holds per history token: K and V of every layer, plus its timestamp."""
    element = torch.empty(0, dtype=dtype).element_size()
    per_layer = config.num_heads * (config.attention_dim + config.linear_dim) * element
    return config.num_layers * per_layer + TIMESTAMP_BYTES


class CachedHSTU:
    """Inference engine over a trained ``HSTU``: encode, extend and score with a ``HistoryCache``.

    ``score`` after ``encode(history)`` equals ``HSTU.forward`` on history + candidates
    with ``num_targets`` (candidates at position L, timestamps as given; with "next_event"
    query times, the last history token's query time is ``request_time``); ``extend`` equals
    encoding the longer history in one pass. Inputs from any device are moved to ``device``.
    """

    def __init__(self, hstu: HSTU, pool: Optional[PagePool] = None) -> None:
        if not isinstance(hstu, HSTU):
            raise TypeError(f"CachedHSTU: expected an HSTU module, got {type(hstu).__name__}")
        self.hstu = hstu.eval()
        self.config = hstu.config
        self.pool = pool  # where new caches' K/V go (None: each cache's own tensors)
        # whether the last history token's output waits for the time of the event after it
        self.defers_last = hstu.config.query_time == "next_event" and hstu.config.time_buckets > 0

    @property
    def device(self) -> torch.device:
        """Where the HSTU's parameters, every cache tensor and every output are."""
        return next(self.hstu.parameters()).device

    def can_extend(self, cache: HistoryCache) -> bool:
        """False while the history is shorter than contextual_len: contextual tokens see each
        other in both directions, so such a history must be re-encoded, not extended."""
        return cache.length >= self.config.contextual_len

    @torch.inference_mode()
    def encode(self, x: Tensor, timestamps: Optional[Tensor]) -> HistoryCache:
        """x: [L, D] float PrefixDNN output of the history; timestamps: [L] int64 -> cache
        (the last token pending when the engine ``defers_last``)."""
        return self.encode_batch([x], [timestamps])[0][0]

    @torch.inference_mode()
    def encode_batch(
        self, xs: Sequence[Tensor], timestamps: Sequence[Optional[Tensor]]
    ) -> List[Tuple[HistoryCache, Tensor]]:
        """``encode`` of several users' histories, all in one jagged pass.

        xs[b]: [L_b, D] float; timestamps[b]: [L_b] int64 or None
        -> per user (its cache, the HSTU outputs of its committed tokens [C_b, D])"""
        return [encoded for encoded, _, _ in self._encode(xs, timestamps, None)]

    @torch.inference_mode()
    def encode_settled_batch(
        self, xs: Sequence[Tensor], timestamps: Sequence[Optional[Tensor]], request_times: Sequence[int]
    ) -> List[Tuple[Tuple[HistoryCache, Tensor], Tuple[HistoryCache, Tensor]]]:
        """``encode_batch``, then ``settle_batch`` of its caches at ``request_times`` (seconds), in one
        pass where the engine defers the last token: it runs with the others, asked at its request
        time, its K/V kept by the settled cache only (the encoded cache keeps it pending). A history
        of at most contextual_len tokens is settled in a pass of its own (its last token is
        contextual: the others would see it).

        -> per user ((its cache, the outputs of its committed tokens [C_b, D]), (its settled cache,
        nothing pending, the outputs of the tokens settled [p_b, D]))"""
        return [(encoded, settled) for encoded, settled, _ in self._encode_settled(xs, timestamps, request_times)]

    @torch.inference_mode()
    def encode_scored_batch(
        self,
        xs: Sequence[Tensor],
        timestamps: Sequence[Optional[Tensor]],
        request_times: Sequence[int],
        targets: Sequence[Optional[Tuple[Tensor, Optional[Tensor]]]],
    ) -> List[Tuple[Tuple[HistoryCache, Tensor], Tuple[HistoryCache, Tensor], Optional[Tensor]]]:
        """``encode_settled_batch``, then ``score`` of each settled cache with its user's targets
        (targets[b]: (x [N_b, D] float, timestamps [N_b] int64 or None), the request's candidates, or
        None: none), in the one pass where the user's last token settles: its targets follow its
        history there, as in the one-pass target-aware forward (``HSTU.forward`` with ``num_targets``).

        -> per user (as ``encode_settled_batch``, its targets' HSTU outputs [N_b, D] or None)"""
        out = []
        for b, (encoded, settled, scored) in enumerate(self._encode_settled(xs, timestamps, request_times, targets)):
            target = targets[b]
            if scored is None and target is not None:  # its last token settled in a pass of its own: its targets too
                scored = self.score(settled[0], target[0], target[1], max(1, target[0].shape[0]), request_times[b])
            out.append((encoded, settled, scored))
        return out

    def _encode_settled(
        self,
        xs: Sequence[Tensor],
        timestamps: Sequence[Optional[Tensor]],
        request_times: Sequence[int],
        targets: Optional[Sequence[Optional[Tuple[Tensor, Optional[Tensor]]]]] = None,
    ) -> List[Tuple[Tuple[HistoryCache, Tensor], Tuple[HistoryCache, Tensor], Optional[Tensor]]]:
        """``_encode``, the users it did not settle settled in one more pass."""
        encoded = self._encode(xs, timestamps, request_times, targets)
        alone = [b for b, (_, settled, _) in enumerate(encoded) if settled is None]
        settled_alone = dict(
            zip(alone, self.settle_batch([encoded[b][0][0] for b in alone], [request_times[b] for b in alone]))
        )
        return [
            (one, settled_alone[b] if settled is None else settled, scored)
            for b, (one, settled, scored) in enumerate(encoded)
        ]

    def _encode(
        self,
        xs: Sequence[Tensor],
        timestamps: Sequence[Optional[Tensor]],
        request_times: Optional[Sequence[int]],
        targets: Optional[Sequence[Optional[Tuple[Tensor, Optional[Tensor]]]]] = None,
    ) -> List[Tuple[Tuple[HistoryCache, Tensor], Optional[Tuple[HistoryCache, Tensor]], Optional[Tensor]]]:
        """``encode_scored_batch``, each settled cache None where this pass did not settle it (a
        contextual last token), and then its targets' outputs None too; without ``request_times``
        nothing is settled, without ``targets`` nothing scored."""
        device = self.device  # looked up once: it walks the parameters
        xs = [x.to(device) for x in xs]
        lengths = [self._check_tokens(x, t, start=0) for x, t in zip(xs, timestamps)]
        ts = [self._timestamps(t, n, device) for t, n in zip(timestamps, lengths)]
        committed = [n - 1 if self.defers_last and n else n for n in lengths]
        # the users whose pending token runs in this pass, asked at the request's time
        settles = [
            request_times is not None and (not self.defers_last or n > self.config.contextual_len) for n in lengths
        ]
        ran = [n if settle else c for n, c, settle in zip(lengths, committed, settles)]
        # each settled user's targets (None: none run), after its history at its length, asked at their own times
        aimed: List[Optional[Tuple[Tensor, Tensor]]] = [None] * len(xs)
        for b, (target, settle) in enumerate(zip(targets or (), settles)):
            if settle and target is not None:
                count = self._check_tokens(target[0], target[1], start=lengths[b], targets=True)
                aimed[b] = (target[0].to(device), self._timestamps(target[1], count, device))
        aims = [0 if aim is None else int(aim[0].shape[0]) for aim in aimed]
        run = [b for b, n in enumerate(ran) if n + aims[b]]  # users with tokens to run
        offsets = offsets_from_lengths(torch.tensor([ran[b] + aims[b] for b in run], dtype=torch.long))
        starts = dict(zip(run, offsets.tolist()))
        keys: List[Tensor] = []
        values: List[Tensor] = []
        if run:
            pieces: List[Tensor] = []
            positions_of: List[Tensor] = []
            times: List[Tensor] = []
            asked: List[Tensor] = []  # each token's query time: the next one's timestamp, a settled last one's request
            for b in run:
                pieces.append(xs[b][: ran[b]])
                positions_of.append(torch.arange(ran[b], device=device))
                times.append(ts[b][: ran[b]])
                asked.append(ts[b][1 : ran[b] + 1])
                if request_times is not None and committed[b] < ran[b]:  # its pending token runs
                    asked.append(ts[b].new_tensor([int(request_times[b])]))
                aim = aimed[b]
                if aim is not None:
                    pieces.append(aim[0])
                    positions_of.append(torch.full((aims[b],), ran[b], device=device))
                    times.append(aim[1])
                    asked.append(aim[1])
            x = torch.cat(pieces)
            offsets = offsets.to(x.device)
            positions, flat_ts = torch.cat(positions_of), torch.cat(times)
            query_ts = torch.cat(asked) if self.defers_last else None
            num_targets = None if targets is None else torch.tensor([aims[b] for b in run], device=x.device)
            workspace = AttentionWorkspace(offsets)
            hidden = self.hstu.embed(x, positions)
            longest = max(ran[b] + aims[b] for b in run)
            # cast: torch's stubs type nn.ModuleList's items as nn.Module
            for layer in cast(Sequence[HSTULayer], self.hstu.layers):
                u, q, k, v = layer.project(hidden)
                attn = layer.attend(
                    q, k, v, offsets, longest, flat_ts, num_targets, query_times=query_ts, workspace=workspace
                )
                hidden = layer.combine(hidden, attn, u)
                keys.append(k.transpose(0, 1))
                values.append(v.transpose(0, 1))
        out: List[Tuple[Tuple[HistoryCache, Tensor], Optional[Tuple[HistoryCache, Tensor]], Optional[Tensor]]] = []
        for b, x in enumerate(xs):
            if b in starts:
                rows = slice(starts[b], starts[b] + committed[b])
                layers_k, layers_v = [k[:, rows] for k in keys], [v[:, rows] for v in values]
                outputs = hidden[rows]
            else:
                layers_k, layers_v = self._empty_kv(x)
                outputs = x.new_zeros(0, self.config.hidden_dim)
            pending = x[committed[b] :] if committed[b] < lengths[b] else None
            paged = None if self.pool is None else self.pool.store(layers_k, layers_v)
            if paged is not None:
                cache = HistoryCache((), (), ts[b], pending, paged)
            else:
                cached_k, cached_v = tuple(k.contiguous() for k in layers_k), tuple(v.contiguous() for v in layers_v)
                cache = HistoryCache(cached_k, cached_v, ts[b], pending)
            settled = scored = None
            if settles[b] and pending is None:  # nothing to settle
                settled = (cache, outputs[:0])
            elif settles[b]:
                last = slice(starts[b] + committed[b], starts[b] + lengths[b])
                grown = self._grown(cache, keys, values, last)
                settled = (replace(grown, timestamps=ts[b], pending=None), hidden[last])
            if aimed[b] is not None:
                first = starts[b] + lengths[b] if b in starts else 0
                scored = hidden[first : first + aims[b]] if b in starts else outputs[:0]
            out.append(((cache, outputs), settled, scored))
        return out

    @torch.inference_mode()
    def outputs_batch(
        self, x: Tensor, offsets: Tensor, timestamps: Optional[Tensor], request_times: Optional[Tensor] = None
    ) -> Tensor:
        """The HSTU outputs at every token of B histories, all in one jagged pass that keeps no cache
        (``HSTU.forward``): what ``encode_batch``, then ``settle_batch`` at ``request_times`` when the
        engine defers the last token, give for them, without building any user's ``HistoryCache``.

        x: [T, D] float, history b's tokens at rows [offsets[b], offsets[b+1]); offsets: [B+1] int64
        timestamps: [T] int64 or None; request_times: [B] int64 seconds, the query time of each
        non-empty history's last token (needed when the engine ``defers_last``; a token's query
        time is otherwise the next token's timestamp) -> [T, D]"""
        device = self.device
        x, offsets = x.to(device), offsets.to(device)
        lengths = offsets.diff()
        longest = int(lengths.max()) if lengths.numel() else 0
        self._check_history(longest, timestamps)
        ts = None if timestamps is None else timestamps.to(device=device, dtype=torch.long)
        query_ts = None
        if self.defers_last:
            if request_times is None or request_times.shape != lengths.shape:
                raise ValueError(
                    f"HSTU cache: request_times [{lengths.numel()}] are required: the last history token's output "
                    "depends on the time of the request (HSTUConfig.query_time is 'next_event')"
                )
            assert ts is not None  # defers_last needs time_buckets, checked above
            query_ts = torch.cat([ts[1:], ts[:1]])
            ends = lengths > 0
            query_ts[offsets[1:][ends] - 1] = request_times.to(device=device, dtype=torch.long)[ends]
        return self.hstu(x, offsets, longest, ts, None, query_ts)

    @torch.inference_mode()
    def extend(self, cache: HistoryCache, x: Tensor, timestamps: Optional[Tensor]) -> HistoryCache:
        """Append n history tokens, computing only them (and the pending one, whose next event
        they bring). x: [n, D] float; timestamps: [n] int64."""
        return self.extend_batch([cache], [x], [timestamps])[0][0]

    @torch.inference_mode()
    def extend_batch(
        self, caches: Sequence[HistoryCache], xs: Sequence[Tensor], timestamps: Sequence[Optional[Tensor]]
    ) -> List[Tuple[HistoryCache, Tensor]]:
        """``extend`` of several users' caches, their new tokens in one pass.

        xs[b]: [n_b, D] float; timestamps[b]: [n_b] int64 or None
        -> per user (the extended cache, the HSTU outputs of the tokens it commits [c_b, D])"""
        tokens, times, new = self._grown_tokens(caches, xs, timestamps)
        # the tokens to commit: all, or all but the last when it waits for its next event
        runs = [0 if n == 0 else t.shape[0] - int(self.defers_last) for t, n in zip(tokens, new)]
        run = [b for b, r in enumerate(runs) if r]
        committed = self.commit_batch(
            [caches[b] for b in run],
            [tokens[b][: runs[b]] for b in run],
            [times[b][caches[b].committed :] for b in run],
        )
        done = dict(zip(run, committed))
        out = []
        for b, cache in enumerate(caches):
            if b not in done:  # no new token, or one that waits for its next event: nothing to run
                grown = cache if new[b] == 0 else replace(cache, timestamps=times[b], pending=tokens[b])
                out.append((grown, tokens[b].new_zeros(0, self.config.hidden_dim)))
                continue
            grown, hidden = done[b]
            pending = tokens[b][runs[b] :] if runs[b] < tokens[b].shape[0] else None
            out.append((replace(grown, timestamps=times[b], pending=pending), hidden))
        return out

    @torch.inference_mode()
    def extend_settled_batch(
        self,
        caches: Sequence[HistoryCache],
        xs: Sequence[Tensor],
        timestamps: Sequence[Optional[Tensor]],
        request_times: Sequence[int],
    ) -> List[Tuple[Tuple[HistoryCache, Tensor], Tuple[HistoryCache, Tensor]]]:
        """``extend_batch``, then ``settle_batch`` of its caches at ``request_times`` (seconds), with
        one pass for both where the engine defers the last token: a user's pending and new tokens
        run together, the last one asked at its request time, its K/V kept by the settled cache
        only (the extended cache keeps it pending, as ``extend_batch``'s does). A user without new
        tokens is settled alone.

        -> per user ((the extended cache, the outputs of the tokens it commits [c_b, D]),
        (its settled cache, nothing pending, the outputs of the tokens settled [p_b, D]))"""
        if not self.defers_last:
            return [(e, (e[0], e[1][:0])) for e in self.extend_batch(caches, xs, timestamps)]
        tokens, times, new = self._grown_tokens(caches, xs, timestamps)
        out: Dict[int, Tuple[Tuple[HistoryCache, Tensor], Tuple[HistoryCache, Tensor]]] = {}
        run = [b for b, n in enumerate(new) if n]
        if run:  # token i asked at token i + 1's time, the last at the request's
            asked = [
                torch.cat([times[b][caches[b].committed :], times[b].new_tensor([int(request_times[b])])]) for b in run
            ]
            hidden, keys, values, bounds = self._run_history([caches[b] for b in run], [tokens[b] for b in run], asked)
            for j, b in enumerate(run):
                kept, last = slice(bounds[j], bounds[j + 1] - 1), slice(bounds[j + 1] - 1, bounds[j + 1])
                extended = replace(
                    self._grown(caches[b], keys, values, kept),
                    timestamps=times[b],
                    pending=tokens[b][-1:],
                )
                settled = replace(
                    self._grown(extended, keys, values, last),
                    timestamps=times[b],
                    pending=None,
                )
                out[b] = ((extended, hidden[kept]), (settled, hidden[last]))
        rest = [b for b, n in enumerate(new) if not n]
        settled_alone = self.settle_batch([caches[b] for b in rest], [request_times[b] for b in rest])
        for b, settled_one in zip(rest, settled_alone):
            out[b] = ((caches[b], tokens[b].new_zeros(0, self.config.hidden_dim)), settled_one)
        return [out[b] for b in range(len(caches))]

    def _grown_tokens(
        self, caches: Sequence[HistoryCache], xs: Sequence[Tensor], timestamps: Sequence[Optional[Tensor]]
    ) -> Tuple[List[Tensor], List[Tensor], List[int]]:
        """The extension of each cache checked -> per user (its uncommitted tokens: the pending ones, then
        the new [u_b, D]; every history timestamp after the extension [L_b + n_b]; its new tokens n_b)."""
        for cache in caches:
            if not self.can_extend(cache):
                raise ValueError(
                    f"HSTU cache: a history of {cache.length} tokens is shorter than HSTUConfig.contextual_len "
                    f"{self.config.contextual_len}; encode the whole history instead"
                )
        tokens, times, new = [], [], []
        for cache, x, t in zip(caches, xs, timestamps):
            x = x.to(self.device)
            new.append(self._check_tokens(x, t, start=cache.length))
            tokens.append(x if cache.pending is None else torch.cat([cache.pending, x]))
            times.append(torch.cat([cache.timestamps, self._timestamps(t, new[-1], x.device)]))
        return tokens, times, new

    @torch.inference_mode()
    def settle(self, cache: HistoryCache, request_time: Optional[int]) -> Tuple[HistoryCache, Tensor]:
        """Commit the pending history tokens, the request being the event after the last one.

        -> (a cache with nothing pending, the settled tokens' HSTU outputs [p, D])
        request_time: seconds; needed only when something is pending
        """
        return self.settle_batch([cache], [request_time])[0]

    @torch.inference_mode()
    def settle_batch(
        self, caches: Sequence[HistoryCache], request_times: Sequence[Optional[int]]
    ) -> List[Tuple[HistoryCache, Tensor]]:
        """``settle`` for several users' caches, their pending tokens in one pass."""
        out: Dict[int, Tuple[HistoryCache, Tensor]] = {}
        pending = [i for i, c in enumerate(caches) if c.pending is not None]
        settle_times: List[int] = []  # the request time of each pending cache
        for i, cache in enumerate(caches):
            request_time = request_times[i]
            if cache.pending is None:
                out[i] = cache, cache.timestamps.new_zeros(0, self.config.hidden_dim, dtype=torch.float32)
            elif request_time is None:
                raise ValueError(
                    "HSTU cache: request_time is required: the last history token's output depends on "
                    "the time of the request (HSTUConfig.query_time is 'next_event')"
                )
            else:
                settle_times.append(request_time)
        if pending:
            times = [
                torch.cat(
                    [
                        caches[i].timestamps[caches[i].committed :],
                        caches[i].timestamps.new_tensor([int(settle_time)]),
                    ]
                )
                for i, settle_time in zip(pending, settle_times)
            ]
            tokens = [c.pending for c in caches if c.pending is not None]
            committed = self.commit_batch([caches[i] for i in pending], tokens, times)
            for i, (cache, hidden) in zip(pending, committed):
                out[i] = replace(cache, timestamps=caches[i].timestamps), hidden
        return [out[i] for i in range(len(caches))]

    @torch.inference_mode()
    def score(
        self,
        cache: HistoryCache,
        x: Tensor,
        timestamps: Optional[Tensor],
        micro_batch: int = 256,
        request_time: Optional[int] = None,
    ) -> Tensor:
        """HSTU outputs of N candidate tokens against the cached history.

        x: [N, D] float PrefixDNN output of the candidates; timestamps: [N] int64 (request time)
        micro_batch: candidates per pass; the result does not depend on it
        request_time: seconds, needed when the cache has a pending token (see ``settle``)
        returns: [N, D]
        """
        offsets = torch.tensor([0, x.shape[0]], device=x.device)
        return self.score_batch([cache], x, offsets, timestamps, micro_batch, [request_time])

    @torch.inference_mode()
    def score_batch(
        self,
        caches: Sequence[HistoryCache],
        x: Tensor,
        candidate_offsets: Tensor,
        timestamps: Optional[Tensor],
        micro_batch: int = 256,
        request_times: Optional[Sequence[Optional[int]]] = None,
    ) -> Tensor:
        """HSTU outputs of several users' candidates, each against its own cached history, the
        users batched into passes of at most ``micro_batch`` candidates (one user's candidates
        split across passes when it has more). Equals ``score`` user by user.

        x: [N, D] float candidates of B users back to back; candidate_offsets: [B+1] int64
        timestamps: [N] int64 or None; request_times: B seconds or None (see ``settle``)
        returns: [N, D]
        """
        if micro_batch < 1:
            raise ValueError(f"micro_batch: expected >= 1, got {micro_batch}")
        x, timestamps = x.to(self.device), None if timestamps is None else timestamps.to(self.device)
        bounds = candidate_offsets.tolist()
        if len(bounds) != len(caches) + 1 or bounds[-1] != x.shape[0]:
            raise ValueError(f"HSTU cache: candidate_offsets must be [{len(caches) + 1}] ending at {x.shape[0]}")
        for b, cache in enumerate(caches):
            ts = None if timestamps is None else timestamps[bounds[b] : bounds[b + 1]]
            self._check_tokens(x[bounds[b] : bounds[b + 1]], ts, start=cache.length, targets=True)
        settled = [c for c, _ in self.settle_batch(caches, request_times or [None] * len(caches))]
        pieces = [
            (b, start, min(start + micro_batch, bounds[b + 1]))
            for b in range(len(caches))
            for start in range(bounds[b], bounds[b + 1], micro_batch)
        ]
        group: List[Tuple[int, int, int]]
        outputs, group, size = [], [], 0
        for piece in pieces + [None]:
            if group and (piece is None or size + piece[2] - piece[1] > micro_batch):
                rows = torch.cat([torch.arange(s, e) for _, s, e in group]).to(x.device)
                lengths = torch.tensor([e - s for _, s, e in group], device=x.device)
                hidden, _, _ = self._run_new_tokens(
                    [settled[b] for b, _, _ in group],
                    x[rows],
                    offsets_from_lengths(lengths),
                    "targets",
                    None if timestamps is None else timestamps[rows],
                )
                outputs.append(hidden)
                group, size = [], 0
            if piece is not None:
                group.append(piece)
                size += piece[2] - piece[1]
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
        x, timestamps = x.to(self.device), None if timestamps is None else timestamps.to(self.device)
        depths, block_visible = depths.to(self.device), block_visible.to(self.device)
        n = self._check_tokens(x, timestamps, start=cache.length, targets=True)
        if depths.shape != (n,) or block_visible.shape != (n, n):
            raise ValueError(
                f"HSTU cache: depths must be [{n}] and block_visible [{n}, {n}], "
                f"got {tuple(depths.shape)} and {tuple(block_visible.shape)}"
            )
        if n and (int(depths.min()) < 1 or cache.length + int(depths.max()) > self.config.max_seq_len):
            raise ValueError(f"HSTU cache: depths must lie in [1, {self.config.max_seq_len - cache.length}]")
        if not self.can_extend(cache):
            raise ValueError(
                f"HSTU cache: a history of {cache.length} tokens is shorter than "
                f"HSTUConfig.contextual_len {self.config.contextual_len}; encode it instead"
            )
        positions = cache.length + depths.to(torch.long) - 1
        offsets = torch.tensor([0, n], device=x.device)
        return self._run_new_tokens(
            [cache], x, offsets, "history", timestamps, positions=positions, block_visible=block_visible
        )

    def commit_batch(
        self, caches: Sequence[HistoryCache], xs: Sequence[Tensor], times: Sequence[Tensor]
    ) -> List[Tuple[HistoryCache, Tensor]]:
        """Run history tokens right after each cache's committed ones, every user in one pass.

        xs[b]: [n_b, D] float; times[b]: [n_b] int64 their timestamps, or [n_b + 1] when the
        engine defers the last token (then times[b][i + 1] is token i's query time)
        -> per user (a cache of the committed tokens and these, nothing pending; outputs [n_b, D])
        """
        lengths = [x.shape[0] for x in xs]
        if sum(lengths) == 0:
            return [(replace(c, timestamps=c.timestamps[: c.committed], pending=None), x) for c, x in zip(caches, xs)]
        hidden, keys, values, bounds = self._run_history(caches, xs, times)
        out = []
        for b, cache in enumerate(caches):
            rows = slice(bounds[b], bounds[b + 1])
            grown = self._grown(cache, keys, values, rows)
            own_times = times[b][: lengths[b]].to(cache.timestamps.device)
            out.append(
                (replace(grown, timestamps=torch.cat([cache.timestamps[: cache.committed], own_times])), hidden[rows])
            )
        return out

    def _run_history(
        self, caches: Sequence[HistoryCache], xs: Sequence[Tensor], times: Sequence[Tensor]
    ) -> Tuple[Tensor, List[Tensor], List[Tensor], List[int]]:
        """``commit_batch``'s pass (its arguments) -> (outputs [N, D], per-layer keys [H, N, Da] and
        values [H, N, Dl], user b's rows [bounds[b], bounds[b + 1]))."""
        device = self.device
        xs, times = [x.to(device) for x in xs], [t.to(device) for t in times]
        lengths = torch.tensor([x.shape[0] for x in xs])
        x = torch.cat(list(xs))
        timestamps = torch.cat([t[:n] for t, n in zip(times, lengths.tolist())])
        query_times = torch.cat([t[1:] for t in times]) if self.defers_last else None
        offsets = offsets_from_lengths(lengths).to(x.device)
        hidden, keys, values = self._run_new_tokens(caches, x, offsets, "history", timestamps, query_times)
        return hidden, keys, values, offsets.tolist()

    def _grown(self, cache: HistoryCache, keys: List[Tensor], values: List[Tensor], rows: slice) -> HistoryCache:
        """The committed K/V of ``cache`` followed by the new tokens at ``rows`` of a pass's per-layer
        keys and values ([H, N, *]): appended to its pages (no copy of the prefix) when it is paged in
        the engine's pool and the pool has room, else concatenated into new tensors. Timestamps and
        pending are left to the caller."""
        keys, values = [k[:, rows] for k in keys], [v[:, rows] for v in values]
        if cache.paged is not None and cache.paged.pool is self.pool:
            paged = self.pool.append(cache.paged, keys, values)
            if paged is not None:
                return HistoryCache((), (), cache.timestamps, None, paged)
        layers = [cache.layer(i) for i in range(len(keys))]
        return HistoryCache(
            tuple(torch.cat([old[:, : cache.committed], new], dim=1) for (old, _), new in zip(layers, keys)),
            tuple(torch.cat([old[:, : cache.committed], new], dim=1) for (_, old), new in zip(layers, values)),
            cache.timestamps,
        )

    def _run_new_tokens(
        self,
        caches: Sequence[HistoryCache],
        x: Tensor,
        new_offsets: Tensor,
        new_tokens: str,
        timestamps: Optional[Tensor],
        query_times: Optional[Tensor] = None,
        positions: Optional[Tensor] = None,
        block_visible: Optional[Tensor] = None,
    ) -> Tuple[Tensor, List[Tensor], List[Tensor]]:
        """New tokens of B users (x: [N, D], new_offsets: [B+1]) through every layer against the
        committed part of each user's cache (``gr.hstu.kernels.cached_attention.hstu_cached_attention``).

        new_tokens: "targets" or "history"; timestamps: [N] int64 or None
        query_times: [N] int64, each token's query time; None -> its own timestamp
        positions, block_visible: draft-tree layout (see ``run_block``)
        -> (outputs [N, D], per-layer keys [H, N, Da], per-layer values [H, N, Dl])
        """
        committed = [c.committed for c in caches]
        cache_offsets = offsets_from_lengths(torch.tensor(committed)).to(x.device)
        h = self.hstu.embed(
            x, default_positions(new_offsets, cache_offsets, new_tokens) if positions is None else positions
        )
        cache_ts = [c.timestamps[:n] for c, n in zip(caches, committed)]
        pool = self.pool
        # every cache in the engine's pool: attention reads K/V through their page tables
        tables = None
        if pool is not None and all(c.paged is not None and c.paged.pool is pool for c in caches):
            tables = PageTables([cast(PagedKV, c.paged).table for c in caches], pool.page_size)
        keys, values = [], []
        setup = CachedSetup()  # the layers' calls share their requests' masks and bias buckets
        for i, layer in enumerate(cast(Sequence[HSTULayer], self.hstu.layers)):
            u, q, k, v = layer.project(h)
            cache_k: CacheTensor
            cache_v: CacheTensor
            if tables is not None:
                assert pool is not None  # tables come from its pages
                cache_k, cache_v = PagedCache(pool.keys[i], tables), PagedCache(pool.values[i], tables)
            else:  # per user: its pages (read where they lie) or its own tensors
                layers = [
                    c.paged.pages_of(i) if c.paged is not None else (c.keys[i][:, :n], c.values[i][:, :n])
                    for c, n in zip(caches, committed)
                ]
                cache_k, cache_v = [kv[0] for kv in layers], [kv[1] for kv in layers]
            attn = layer.attend_cached(
                q,
                k,
                v,
                new_offsets,
                cache_k,
                cache_v,
                cache_offsets,
                new_tokens=new_tokens,
                positions=positions,
                block_visible=block_visible,
                timestamps=timestamps,
                query_times=timestamps if query_times is None else query_times,
                cache_timestamps=cache_ts,
                setup=setup,
            )
            h = layer.combine(h, attn, u)
            keys.append(k.transpose(0, 1))
            values.append(v.transpose(0, 1))
        return h, keys, values

    def _empty_kv(self, x: Tensor) -> Tuple[List[Tensor], List[Tensor]]:
        c = self.config
        keys = [x.new_zeros(c.num_heads, 0, c.attention_dim) for _ in range(c.num_layers)]
        values = [x.new_zeros(c.num_heads, 0, c.linear_dim) for _ in range(c.num_layers)]
        return keys, values

    def _timestamps(self, timestamps: Optional[Tensor], count: int, device: torch.device) -> Tensor:
        if timestamps is None:
            return torch.zeros(count, dtype=torch.long, device=device)
        return timestamps.to(device=device, dtype=torch.long)

    def _check_tokens(self, x: Tensor, timestamps: Optional[Tensor], start: int, targets: bool = False) -> int:
        """Validate a block of new tokens at ``start``; returns its token count."""
        c = self.config
        if x.dim() != 2 or x.shape[1] != c.hidden_dim:
            raise ValueError(f"HSTU cache: x must be [n, {c.hidden_dim}], got {tuple(x.shape)}")
        if timestamps is not None and timestamps.shape != x.shape[:1]:
            raise ValueError(f"HSTU cache: timestamps must be [{x.shape[0]}], got {tuple(timestamps.shape)}")
        self._check_history(start if targets else start + x.shape[0], timestamps)
        return int(x.shape[0])

    def _check_history(self, length: int, timestamps: Optional[Tensor]) -> None:
        """A history of ``length`` tokens fits max_seq_len, with timestamps where the time bias reads them."""
        c = self.config
        if timestamps is None and c.time_buckets > 0:
            raise ValueError("HSTU cache: timestamps are required when HSTUConfig.time_buckets > 0")
        if length > c.max_seq_len:
            raise ValueError(f"HSTU cache: a history of {length} tokens exceeds HSTUConfig.max_seq_len {c.max_seq_len}")
