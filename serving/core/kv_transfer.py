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
    created: float = 0.0  # time.monotonic()


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
        return [t for t, h in self.held.items() if now - h.created > timeout_s]

    # ---- decode side
    def write(self, request, data: list[np.ndarray]) -> int:
        """Registers the received pages ([num_pages, ...] per leaf) as the prefix-cache blocks of `request`'s
        prompt, writing those it did not hold; returns how many blocks the cache has for it now (the request's
        prefix hit). Pages short (all in use) end the run: the rest is recomputed."""
        bm = self.scheduler.block_manager
        holder = PageHolder()
        num_blocks = data[0].shape[0] if data else 0
        writes = bm.adopt_blocks(holder, list(request.prompt_token_ids), prefix_root(request), num_blocks)
        cached = len(holder.block_table)
        try:
            for k in range(0, len(writes), PAGES_PER_CHUNK):
                part = writes[k:k + PAGES_PER_CHUNK]
                blocks = [i for i, _ in part]
                self.mover.write_pages([p for _, p in part], [d[blocks] for d in data])
            self.pages_in += len(writes)
            self.bytes_in += sum(d[:1].nbytes for d in data) * len(writes)
        finally:
            bm.free(holder)  # the blocks stay cached (evictable) for the request admitted next
        return cached
