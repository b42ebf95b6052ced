"""`KVEventIndex`: what one instance's prefix cache holds, rebuilt from its KV-event stream (vLLM's msgpack
`KVEventBatch` on ZMQ PUB; serving.core.kv_events publishes it), so the gateway's prefix affinity for that instance
is what it actually holds rather than where the gateway last sent a prompt; `subscribe` keeps one up to date.
Details: docs/gateway.md ("Prefix affinity from KV events")."""
from __future__ import annotations

import asyncio
import hashlib
import logging
from typing import Sequence

log = logging.getLogger(__name__)


def block_digest(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """A block's digest over its parent's digest (b"" for a first block) and its tokens: equal digests mean equal
    token prefixes, however the instance names its blocks."""
    data = b"".join(int(t).to_bytes(8, "little", signed=True) for t in token_ids)
    return hashlib.blake2b(parent + data, digest_size=16).digest()


def first_block_extra_keys(adapter: str, salt: str) -> tuple:
    """A first block's extra keys as the instance's events carry them (vLLM's order): the LoRA adapter's name, then
    the instance's cache salt (`serving.wire.requests.prefix_cache_salt`)."""
    return ((adapter,) if adapter else ()) + ((salt,) if salt else ())


def scope_digest(extra_keys) -> bytes:
    """Where a chain of digests starts for a first block with `extra_keys`: b"" for none (the base model,
    unsalted), else a digest of them, so blocks under another adapter or salt never match."""
    if not extra_keys:
        return b""
    import msgpack
    return hashlib.blake2b(msgpack.packb(list(extra_keys)), digest_size=16).digest()


class KVEventIndex:
    """Blocks an instance holds in any tier, as token-prefix digests under the first block's extra keys (its LoRA
    adapter and cache salt): a prompt matches only blocks stored under its own. A block whose parent the index
    does not know (evicted before the gateway saw it, or stored before it subscribed) is left out: a prefix cache
    reuses only a leading run of blocks, so it could not be matched anyway."""

    def __init__(self):
        self.block_size = 0  # from the stored events (0: none seen yet)
        self._blocks: dict[object, tuple[bytes, set]] = {}  # the instance's block hash -> (digest, tiers holding it)
        self._digests: dict[bytes, int] = {}  # digest -> how many of the instance's blocks have it
        self.last_seq = -1
        self.batches = 0

    def __len__(self) -> int:
        return len(self._digests)

    def clear(self) -> None:
        self._blocks.clear()
        self._digests.clear()

    def apply(self, seq: int, batch: list) -> None:
        """One KVEventBatch [ts, events, data parallel rank] numbered `seq`; a gap in the numbers (messages lost,
        or the instance restarted) empties the index first: it may have missed removals."""
        if self.last_seq >= 0 and seq != self.last_seq + 1:
            log.warning("KV events: batch %d after %d; index reset", seq, self.last_seq)
            self.clear()
        self.last_seq = seq
        self.batches += 1
        for event in batch[1]:
            kind = event[0]
            if kind == "BlockStored":
                hashes, parent, tokens, size = event[1], event[2], event[3], event[4]
                medium = event[6] if len(event) > 6 else None
                extra = event[8] if len(event) > 8 else None  # per block: the first one's starts the chain
                self.block_size = size
                if parent is None:
                    prev = scope_digest(extra[0] if extra else None)
                else:
                    prev = self._blocks.get(parent, (None,))[0]
                for i, h in enumerate(hashes):  # several blocks of one request: each the next one's parent
                    block = tokens[i * size:(i + 1) * size]
                    if prev is None or len(block) < size:
                        break
                    prev = block_digest(prev, block)
                    self._add(h, prev, medium)
            elif kind == "BlockRemoved":
                medium = event[2] if len(event) > 2 else None
                for h in event[1]:
                    self._remove(h, medium)
            elif kind == "AllBlocksCleared":
                self.clear()

    def _add(self, block_hash, digest: bytes, medium) -> None:
        entry = self._blocks.get(block_hash)
        if entry is None:
            self._blocks[block_hash] = (digest, {medium})
            self._digests[digest] = self._digests.get(digest, 0) + 1
        else:
            entry[1].add(medium)

    def _remove(self, block_hash, medium) -> None:
        entry = self._blocks.get(block_hash)
        if entry is None:
            return
        entry[1].discard(medium)
        if not entry[1]:
            del self._blocks[block_hash]
            n = self._digests[entry[0]] - 1
            if n:
                self._digests[entry[0]] = n
            else:
                del self._digests[entry[0]]

    def prompt_keys(self, token_ids: Sequence[int], extra_keys: tuple = ()) -> list[bytes]:
        """The digests match() takes for a prompt whose first block has `extra_keys` (`first_block_extra_keys`):
        its full blocks but one token (the instance computes the last)."""
        out, prev, bs = [], scope_digest(extra_keys), self.block_size
        for i in range((len(token_ids) - 1) // bs if bs else 0):
            prev = block_digest(prev, token_ids[i * bs:(i + 1) * bs])
            out.append(prev)
        return out

    def match(self, keys: Sequence[bytes]) -> float:
        """The fraction of the prompt's blocks (`prompt_keys`) the instance holds as a leading run."""
        n = 0
        for k in keys:
            if k not in self._digests:
                break
            n += 1
        return n / len(keys) if keys else 0.0


REPLAY_END = -1  # the replay's last message (serving.core.kv_events.REPLAY_END; the gateway does not import core)


async def replay(ctx, endpoint: str, start: int, timeout_s: float = 5.0) -> list[tuple[int, list]] | None:
    """The batches numbered `start` and later that the instance's replay socket (`endpoint`, ZMQ ROUTER) still
    keeps, oldest first; None when it does not answer in `timeout_s`."""
    import msgpack
    import zmq
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    out = []
    try:
        await sock.send_multipart((b"", start.to_bytes(8, "big", signed=True)))
        while True:
            if not await sock.poll(int(timeout_s * 1000)):
                log.warning("KV events: replay from %s did not answer in %.0f s", endpoint, timeout_s)
                return None
            frames = await sock.recv_multipart()
            seq = int.from_bytes(frames[-2], "big", signed=True)
            if seq == REPLAY_END:
                return out
            out.append((seq, msgpack.unpackb(frames[-1])))
    finally:
        sock.close()


async def subscribe(endpoint: str, index: KVEventIndex, stopped, replay_endpoint: str = "") -> None:
    """Applies the batches published on `endpoint` (ZMQ SUB) to `index` until `stopped()` or cancelled. With the
    instance's `replay_endpoint`: first the batches it published before this subscription (still kept), and after
    a gap in the numbers the ones missed, instead of emptying the index."""
    import msgpack
    import zmq
    import zmq.asyncio
    ctx = zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)  # first: what is published from now on queues while the replay runs
    log.info("KV events: subscribed to %s%s", endpoint, f" (replay {replay_endpoint})" if replay_endpoint else "")
    replayed = -1  # batches up to this number came from the replay: their live copies are skipped

    async def catch_up(start: int) -> None:
        nonlocal replayed
        for seq, batch in await replay(ctx, replay_endpoint, start) or ():
            index.apply(seq, batch)
            replayed = seq

    try:
        if replay_endpoint:
            await catch_up(0)
        while not stopped():
            if not await sock.poll(500):
                continue
            frames = await sock.recv_multipart()
            if len(frames) != 3:
                continue
            try:
                seq = int.from_bytes(frames[1], "big", signed=True)
                if 0 <= seq <= replayed:  # applied from the replay already
                    continue
                replayed = -1
                if replay_endpoint and index.last_seq >= 0 and seq > index.last_seq + 1:
                    await catch_up(index.last_seq + 1)  # lost at the socket: the replay has them
                    if seq <= index.last_seq:
                        continue
                index.apply(seq, msgpack.unpackb(frames[2]))
            except (ValueError, TypeError, IndexError, KeyError) as e:  # a malformed batch: start over
                log.warning("KV events from %s: bad batch (%s); index reset", endpoint, e)
                index.clear()
    except asyncio.CancelledError:
        raise
    finally:
        sock.close()
