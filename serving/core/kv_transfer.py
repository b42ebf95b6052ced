"""`KVTransfers`: an engine's side of prefill/decode disaggregation, run on the engine thread: a prefill instance
holds a finished prompt's cached pages for a transfer id and reads them out; a decode instance writes received pages
into its own and registers them in its prefix cache. The wire side is serving.server.disagg. Details:
docs/disaggregation.md."""
from __future__ import annotations

import dataclasses
import time
import uuid

import numpy as np

from serving.core.block_manager import prefix_root
from serving.core.host_kv import HostKVPool

PAGES_PER_CHUNK = 16  # the largest transfer program (pages); a transfer's pages move in chunks of at most this


def repack(data: list[np.ndarray], page_size: int, to_page_size: int) -> list[np.ndarray]:
    """Pages of `page_size` tokens ([pages, page_size, ...] per cache leaf) as pages of `to_page_size`: the same
    tokens in order; a last page the tokens do not fill is dropped (the receiver recomputes those tokens)."""
    if page_size == to_page_size:
        return data
    out = []
    for d in data:
        tokens = d.reshape((-1,) + d.shape[2:])
        n = tokens.shape[0] // to_page_size
        out.append(tokens[:n * to_page_size].reshape((n, to_page_size) + d.shape[2:]))
    return out


class Repacker:
    """`repack` piece by piece (a streamed pull): each `add` returns the receiver's whole pages its pieces have
    completed so far, as (first block index, [pages, to_page_size, ...] per leaf); the tokens left over wait for
    the next piece."""

    def __init__(self, page_size: int, to_page_size: int):
        self.page_size, self.to_page_size = page_size, to_page_size
        self.pending: list[np.ndarray] | None = None
        self.next_block = 0

    def add(self, data: list[np.ndarray]) -> tuple[int, list[np.ndarray]]:
        first = self.next_block
        if self.page_size == self.to_page_size:
            self.next_block += data[0].shape[0]
            return first, data
        tokens = [d.reshape((-1,) + d.shape[2:]) for d in data]
        if self.pending is not None:
            tokens = [np.concatenate([p, t]) for p, t in zip(self.pending, tokens)]
        n, to = tokens[0].shape[0] // self.to_page_size, self.to_page_size
        self.pending = [t[n * to:] for t in tokens]
        self.next_block += n
        return first, [t[:n * to].reshape((n, to) + t.shape[1:]) for t in tokens]


def compatible(theirs: list[tuple[tuple[int, ...], str]], mine: list[tuple[tuple[int, ...], str]]) -> bool:
    """Whether pages of layout `theirs` (KVTransfers.layout) can be repacked into `mine`: the same leaves, rows and
    dtypes; the page size (each page shape's first axis) may differ."""
    return len(theirs) == len(mine) and all(a[1:] == b[1:] and da == db for (a, da), (b, db) in zip(theirs, mine))


@dataclasses.dataclass(slots=True)
class PageHolder:
    """Holds pages in the block manager's books like a request would (block_table, prefix ids)."""
    block_table: list[int] = dataclasses.field(default_factory=list)
    block_prefix_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0
    created: float = 0.0  # time.monotonic(): when the prefill ended (the hold's timeout counts from there)
    open: bool = False  # a streaming transfer whose prefill still runs: its blocks are held as its chunks end
    token_ids: list[int] = dataclasses.field(default_factory=list)  # open: the prompt
    root: object = None  # open: the prompt's prefix root
    first_token_id: int = -1  # once the prefill ended (streaming)


class KVTransfers:
    """Pins, reads and writes whole KV pages of `engine` (an Engine with one runner: not data-parallel, not
    pipelined, not multi-host, one page pool). Every method runs on the engine thread (AsyncEngine.call)."""

    def __init__(self, engine):
        if not hasattr(engine, "runner"):
            raise ValueError("--role: prefill/decode disaggregation is not available here: a data-parallel engine "
                             "(--dp > 1); run one instance per replica")
        why = [reason for reason, bad in (
            ("--enable_prefix_caching is off", not engine.config.enable_prefix_caching),
            ("the KV cache is hybrid (sliding-window pools)", bool(getattr(engine.runner, "window_pages", None))),
            ("--pp > 1", engine.config.pp > 1), ("multi-host", engine.runner.multihost)) if bad]
        if why:
            raise ValueError(f"--role: prefill/decode disaggregation is not available here: {'; '.join(why)}")
        self.engine = engine
        self.scheduler = engine.scheduler
        self.page_size = engine.config.page_size
        self.chunk_tokens = engine.config.max_num_batched_tokens  # a longer prompt's prefill takes several steps
        self.mover = HostKVPool(engine.runner, 0, PAGES_PER_CHUNK)  # no host slots: only its transfer programs
        self.held: dict[str, PageHolder] = {}
        self.pages_out = self.pages_in = 0
        self.bytes_out = self.bytes_in = 0

    def warmup(self) -> int:
        n = self.mover.warmup()
        self.engine.runner.compile_count += n
        return n

    def layout(self) -> list[tuple[tuple[int, ...], str]]:
        """Per cache leaf, one page's shape and dtype name: both sides must agree."""
        return [(h.row_shape, h.dtype.name) for h in self.mover.leaves]

    @property
    def num_held_pages(self) -> int:
        return sum(len(h.block_table) for h in self.held.values())

    # ---- prefill side
    def hold(self, request) -> tuple[str, int]:
        """After `request` finished: holds the device pages of its prompt's cached full blocks under a new
        transfer id; returns (transfer id, pages held)."""
        holder = PageHolder(created=time.monotonic())
        n = self.scheduler.block_manager.pin_prefix(holder, list(request.prompt_token_ids), prefix_root(request))
        transfer_id = uuid.uuid4().hex
        self.held[transfer_id] = holder
        self.scheduler.kv_holders.append(holder)
        return transfer_id, n

    def open(self, request) -> str:
        """Before `request`'s prefill runs (a prompt of several chunks): a transfer whose full blocks are held as
        the steps compute them (`advance`), pullable meanwhile; `finish` ends it. Returns its id."""
        holder = PageHolder(open=True, token_ids=list(request.prompt_token_ids), root=prefix_root(request))
        transfer_id = uuid.uuid4().hex
        self.held[transfer_id] = holder
        self.scheduler.kv_holders.append(holder)
        return transfer_id

    @property
    def streaming(self) -> bool:
        return any(h.open for h in self.held.values())

    def advance(self) -> bool:
        """After a step: holds the blocks it completed of every open transfer; whether any were added."""
        bm = self.scheduler.block_manager
        return sum(bm.pin_more(h, h.token_ids, h.root) for h in self.held.values() if h.open) > 0

    def finish(self, transfer_id: str, first_token_id: int) -> int:
        """The open transfer's prefill ended with `first_token_id`: holds the rest of its prompt's cached blocks
        and starts its timeout; returns the pages held (KeyError: released meanwhile)."""
        holder = self.held[transfer_id]
        self.scheduler.block_manager.pin_more(holder, holder.token_ids, holder.root)
        holder.open, holder.first_token_id, holder.created = False, int(first_token_id), time.monotonic()
        return len(holder.block_table)

    def state(self, transfer_id: str) -> tuple[int, bool, int]:
        """(pages held, prefill still running, first token or -1) of a transfer (KeyError: unknown id)."""
        h = self.held[transfer_id]
        return len(h.block_table), h.open, h.first_token_id

    def read(self, transfer_id: str, first: int, count: int) -> list[np.ndarray]:
        """Pages first .. first + count of a held transfer, per cache leaf (KeyError: unknown id)."""
        pages = self.held[transfer_id].block_table[first:first + count]
        data = self.mover.read_pages(pages)
        self.pages_out += len(pages)
        self.bytes_out += sum(d.nbytes for d in data)
        return data

    def num_pages(self, transfer_id: str) -> int:
        return len(self.held[transfer_id].block_table)

    def release(self, transfer_id: str) -> bool:
        """Drops a transfer's hold (its pages stay in the prefix cache, evictable); False if it was not held."""
        holder = self.held.pop(transfer_id, None)
        if holder is None:
            return False
        self.scheduler.kv_holders.remove(holder)
        self.scheduler.block_manager.free(holder)
        return True

    def expired(self, timeout_s: float) -> list[str]:
        now = time.monotonic()
        return [t for t, h in self.held.items() if not h.open and now - h.created > timeout_s]

    # ---- decode side
    def begin_import(self, holder: PageHolder) -> None:
        """A streamed pull's blocks stay held by `holder` between its pieces (`write(..., holder=)`) until
        `end_import`."""
        self.scheduler.kv_holders.append(holder)

    def end_import(self, holder: PageHolder) -> None:
        """Drops a streamed pull's hold (a no-op the second time): its blocks stay cached, evictable, for the
        request admitted next."""
        if holder in self.scheduler.kv_holders:
            self.scheduler.kv_holders.remove(holder)
            self.scheduler.block_manager.free(holder)

    def write(self, request, data: list[np.ndarray], *, holder: PageHolder | None = None, first_block: int = 0
              ) -> int:
        """Registers the received pages ([num_pages, ...] per leaf) as the prefix-cache blocks of `request`'s
        prompt, writing those it did not hold; returns how many blocks the cache has for it now (the request's
        prefix hit). Pages short (all in use) end the run: the rest is recomputed."""
        bm = self.scheduler.block_manager
        streamed = holder is not None
        holder = holder if streamed else PageHolder()
        num_blocks = data[0].shape[0] if data else 0
        if streamed and (first_block != len(holder.block_table) or holder not in self.scheduler.kv_holders):
            return len(holder.block_table)  # an earlier piece ran out of pages: the rest is recomputed
        bm.note_adapter(request.adapter)
        writes = bm.adopt_blocks(holder, list(request.prompt_token_ids), prefix_root(request),
                                 first_block + num_blocks)
        cached = len(holder.block_table)
        try:
            for k in range(0, len(writes), PAGES_PER_CHUNK):
                part = writes[k:k + PAGES_PER_CHUNK]
                blocks = [i - first_block for i, _ in part]
                self.mover.write_pages([p for _, p in part], [d[blocks] for d in data])
            self.pages_in += len(writes)
            self.bytes_in += sum(d[:1].nbytes for d in data) * len(writes)
        finally:
            if not streamed:
                bm.free(holder)  # the blocks stay cached (evictable) for the request admitted next
        return cached
