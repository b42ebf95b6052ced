"""`Disaggregation`: an instance's wire side of prefill/decode disaggregation (--role): the prefill side holds a
finished prompt's pages per transfer id, serves PullKV / ReleaseKV and releases what nobody pulled in time; the
decode side rewrites a kv_source request into its continuation and pulls and imports the pages before admitting it.
The engine-thread side is serving.core.kv_transfer. Details: docs/disaggregation.md."""
from __future__ import annotations

import asyncio
import logging
import time

import grpc
import numpy as np

from serving.core.kv_transfer import PAGES_PER_CHUNK, KVTransfers, PageHolder, Repacker, compatible
from serving.params import InvalidArgument
from serving.wire import meshserve_pb2 as pb
from serving.wire import meshserve_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

ROLES = ("both", "prefill", "decode")
TRANSPORT = "grpc"  # jax.experimental.transfer does not run on CPU in jax 0.10.2 (docs/disaggregation.md)
DEFAULT_MAX_TOKENS = 16  # SamplingParameters.max_tokens when unset (serving.wire.requests)


class TransferError(Exception):
    """A pull that failed: `code` is the gRPC status the Generate call ends with."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


def continuation(req: pb.GenerateRequest) -> pb.GenerateRequest:
    """A kv_source request as the decode engine reads it: the prompt the prefill instance tokenized (its first
    token is appended to the engine's request by `resume`, as an output token)."""
    src = req.kv_source
    if not src.prompt_token_ids or not src.transfer_id or not src.address:
        raise InvalidArgument("kv_source: needs address, transfer_id and prompt_token_ids")
    s = req.sampling
    max_tokens = s.max_tokens if s.HasField("max_tokens") else DEFAULT_MAX_TOKENS
    if max_tokens < 2:
        raise InvalidArgument(f"kv_source: sampling.max_tokens is {max_tokens}; the prefill instance's first token "
                              "already ended a request of fewer than 2 tokens")
    if s.HasField("structured"):
        raise InvalidArgument("kv_source: structured outputs are not continued across instances; send the request "
                              "whole")
    out = pb.GenerateRequest()
    out.CopyFrom(req)
    out.ClearField("kv_source")
    out.token_ids.ids[:] = list(src.prompt_token_ids)
    return out


def resume(request, first_token_id: int, *, check_only: bool = False) -> None:
    """Appends the prefill instance's first token to the engine's request as its first output token (before it is
    queued): max_tokens, min_tokens, penalties and the seeded draw (by output index) then go on as in one instance.
    `check_only`: only checks the request (a streamed transfer's first token comes after its pages)."""
    if request.sampling_params.n > 1:
        raise InvalidArgument("kv_source: sampling.n must be 1")
    if check_only:
        return
    if first_token_id < 0:
        raise InvalidArgument(f"kv_source: first_token_id is {first_token_id}; the prefill instance's first token")
    request.token_ids.append(int(first_token_id))


def prefill_only(req: pb.GenerateRequest) -> tuple[pb.GenerateRequest, int]:
    """A kv_export request as the prefill engine runs it (one token), and the max_tokens the client asked for."""
    if req.sampling.HasField("n") and req.sampling.n > 1:
        raise InvalidArgument(f"kv_export: sampling.n is {req.sampling.n}; disaggregated requests take n = 1")
    out = pb.GenerateRequest()
    out.CopyFrom(req)
    out.kv_export = False
    max_tokens = req.sampling.max_tokens if req.sampling.HasField("max_tokens") else DEFAULT_MAX_TOKENS
    out.sampling.max_tokens = 1
    out.sampling.min_tokens = min(out.sampling.min_tokens, 1)
    return out, max_tokens


class Disaggregation:
    def __init__(self, aengine, role: str, *, timeout_s: float, peer_key: str = "",
                 peer_tls: grpc.ChannelCredentials | None = None, metrics=None):
        if role not in ROLES[1:]:
            raise ValueError(f"role: {role!r}; disaggregation needs prefill or decode")
        self.aengine = aengine
        self.role = role
        self.timeout_s = timeout_s
        self.transfers = KVTransfers(aengine.engine)  # raises ValueError naming why the engine cannot
        self.metrics = metrics
        self._peer_metadata = (("authorization", f"Bearer {peer_key}"),) if peer_key else ()
        self._peer_credentials = peer_tls  # None: plaintext
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._reaper: asyncio.Task | None = None
        self.expired_total = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tick = asyncio.Event()  # set (and replaced) when a streaming transfer got pages or ended

    async def _call(self, fn):
        return await asyncio.wrap_future(self.aengine.call(lambda e: fn()))

    async def start(self) -> None:
        await self._call(self.transfers.warmup)
        if self.role == "prefill":
            self._loop = asyncio.get_running_loop()
            self._tick = asyncio.Event()
            self.aengine.step_listeners.append(self._on_step)
            self._reaper = asyncio.ensure_future(self._reap())

    def _on_step(self, engine, seconds: float) -> None:
        """Engine thread, after each step: holds the blocks it completed of the streaming transfers and wakes
        their pulls."""
        if self.transfers.streaming and self.transfers.advance():
            self._loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        tick, self._tick = self._tick, asyncio.Event()
        tick.set()

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        for ch in self._channels.values():
            await ch.close()

    async def _reap(self) -> None:
        """Releases the transfers nobody pulled and released within timeout_s (a decode instance that died)."""
        while True:
            await asyncio.sleep(min(1.0, self.timeout_s / 4))
            try:
                gone = await self._call(lambda: [t for t in self.transfers.expired(self.timeout_s)
                                                 if self.transfers.release(t)])
            except Exception:  # noqa: BLE001 - the engine is gone: nothing is held any more
                return
            if gone:
                self.expired_total += len(gone)
                log.warning("released %d KV transfers nobody pulled within %.1fs", len(gone), self.timeout_s)

    # ---- prefill side
    async def open(self, request) -> pb.KVTransfer:
        """A streaming transfer for `request`, before its prefill runs: the first response names it."""
        transfer_id = await self._call(lambda: self.transfers.open(request))
        return pb.KVTransfer(transfer_id=transfer_id, prompt_token_ids=request.prompt_token_ids,
                             page_size=self.transfers.page_size, transport=TRANSPORT, timeout_s=self.timeout_s,
                             streaming=True)

    async def finish(self, transfer_id: str, request, first_token_id: int) -> pb.KVTransfer:
        """The streaming transfer's prefill ended: its pulls get the rest and the first token."""
        try:
            n = await self._call(lambda: self.transfers.finish(transfer_id, first_token_id))
        finally:
            self._wake()
        return pb.KVTransfer(transfer_id=transfer_id, prompt_token_ids=request.prompt_token_ids, num_pages=n,
                             page_size=self.transfers.page_size, transport=TRANSPORT, timeout_s=self.timeout_s)

    def abandon(self, transfer_id: str) -> None:
        """The streaming transfer's request failed or ended without a handoff: its pages go now, its pulls end."""
        fut = self.aengine.call(lambda e: self.transfers.release(transfer_id))  # not awaited: also on a cancel
        fut.add_done_callback(lambda _: self._loop.call_soon_threadsafe(self._wake))

    async def hold(self, request) -> pb.KVTransfer:
        transfer_id, n = await self._call(lambda: self.transfers.hold(request))
        return pb.KVTransfer(transfer_id=transfer_id, prompt_token_ids=request.prompt_token_ids, num_pages=n,
                             page_size=self.transfers.page_size, transport=TRANSPORT, timeout_s=self.timeout_s)

    async def pull_kv(self, request: pb.PullKVRequest, context):
        """The transfer's pages in chunks of at most PAGES_PER_CHUNK, each as soon as it is held (a streaming
        transfer's as its prefill's chunks end), then a last message (no pages) with the first token."""
        if self.role != "prefill":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"PullKV: this instance's role is {self.role}; "
                                "pages are pulled from --role=prefill instances")
        tid = request.transfer_id
        chunk = min(request.pages_per_chunk or PAGES_PER_CHUNK, PAGES_PER_CHUNK)
        layout = [pb.KVLeaf(page_shape=shape, dtype=dtype) for shape, dtype in self.transfers.layout()]
        sent, first_msg = 0, True
        while True:
            tick = self._tick
            try:
                held, running, first_token = await self._call(lambda: self.transfers.state(tid))
                while sent < held:
                    count = min(chunk, held - sent)
                    data = await self._call(lambda first=sent, count=count: self.transfers.read(tid, first, count))
                    msg = pb.KVPages(first_page=sent, num_pages=count, leaves=[d.tobytes() for d in data],
                                     prefill_done=not running)
                    if first_msg:
                        msg.layout.extend(layout)
                        msg.page_size, msg.total_pages, first_msg = self.transfers.page_size, held, False
                    yield msg
                    sent += count
            except KeyError:
                await context.abort(grpc.StatusCode.NOT_FOUND, (
                    f"transfer_id: no KV transfer {tid!r} is held here (released, its prefill failed, or not pulled "
                    f"within {self.timeout_s:g}s)") if first_msg else (
                    f"transfer_id: KV transfer {tid!r} was released while it was pulled (its prefill failed or was "
                    "cancelled, or it timed out)"))
            if not running:
                msg = pb.KVPages(first_page=sent, prefill_done=True, last=True, first_token_id=first_token)
                if first_msg:
                    msg.layout.extend(layout)
                    msg.page_size, msg.total_pages = self.transfers.page_size, held
                yield msg
                return
            try:  # the next step that completes a block, or the prefill's end, wakes this
                await asyncio.wait_for(tick.wait(), 1.0)
            except asyncio.TimeoutError:
                pass

    async def release_kv(self, request: pb.ReleaseKVRequest, context) -> pb.ReleaseKVResponse:
        released = await self._call(lambda: self.transfers.release(request.transfer_id))
        return pb.ReleaseKVResponse(released=released)

    # ---- decode side
    def _stub(self, address: str) -> pb_grpc.InferenceStub:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = (grpc.aio.secure_channel(address, self._peer_credentials)
                                            if self._peer_credentials else grpc.aio.insecure_channel(address))
        return pb_grpc.InferenceStub(ch)

    async def pull(self, src: pb.KVSource, request, timeout_s: float) -> tuple[int, dict]:
        """Pulls transfer `src` from its prefill instance (still held there: `release`) and writes each piece into
        this instance's pages and prefix cache as it arrives (a streamed transfer's while the prefill's later
        chunks run), held until the pull ends. Returns (the blocks the prefix cache has for `request`'s prompt,
        info: bytes, seconds, transport, pages, pieces, pieces received while the prefill ran, first_token_id).
        Raises TransferError (ABORTED: the prefill instance failed or is gone, or released the transfer;
        FAILED_PRECONDITION: the two sides' pages differ)."""
        t0 = time.perf_counter()
        stub = self._stub(src.address)
        mine = self.transfers.layout()
        pools = self.transfers.mover.leaves
        holder = PageHolder()
        self.aengine.call(lambda e: self.transfers.begin_import(holder))  # commands run in order: no await
        theirs, repacker, last = mine, None, None
        nbytes = pages = pieces = early = cached = 0
        try:
            async for msg in stub.PullKV(pb.PullKVRequest(transfer_id=src.transfer_id), timeout=timeout_s,
                                         metadata=self._peer_metadata):
                if repacker is None:  # the first message
                    theirs, page_size = [(tuple(leaf.page_shape), leaf.dtype) for leaf in msg.layout], msg.page_size
                    if not compatible(theirs, mine) or any(shape[0] != page_size for shape, _ in theirs):
                        raise TransferError(grpc.StatusCode.FAILED_PRECONDITION, (
                            f"kv_source: the prefill instance's pages (page_size {page_size}, leaves {theirs}) do not "
                            f"fit this instance's (page_size {self.transfers.page_size}, leaves {mine}); pair "
                            "instances of the same model and KV dtype (page sizes may differ)"))
                    repacker = Repacker(page_size, self.transfers.page_size)  # the receiver repacks to its size
                if msg.num_pages:
                    data = [np.frombuffer(b, pool.dtype).reshape((msg.num_pages,) + shape)
                            for b, (shape, _), pool in zip(msg.leaves, theirs, pools)]
                    first, blocks = repacker.add(data)
                    if blocks and blocks[0].shape[0]:
                        cached = await self._call(lambda first=first, blocks=blocks: self.transfers.write(
                            request, blocks, holder=holder, first_block=first))
                    nbytes += sum(len(b) for b in msg.leaves)
                    pages, pieces, early = pages + msg.num_pages, pieces + 1, early + (not msg.prefill_done)
                if msg.last:
                    last = msg
        except grpc.RpcError as e:
            # ABORTED, not UNAVAILABLE: this instance is fine (a gateway marks an UNAVAILABLE instance failed)
            code = grpc.StatusCode.ABORTED if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED else e.code()
            raise TransferError(code, f"kv_source: pulling transfer {src.transfer_id} from {src.address} failed "
                                f"({e.code().name}: {e.details()}); retry the request from its prefill") from None
        finally:
            self.aengine.call(lambda e: self.transfers.end_import(holder))  # also on a cancel: not awaited
        if last is None and src.streamed:
            raise TransferError(grpc.StatusCode.ABORTED, f"kv_source: transfer {src.transfer_id} from {src.address} "
                                "ended without its first token; retry the request from its prefill")
        return cached, {"bytes": nbytes, "seconds": time.perf_counter() - t0, "transport": TRANSPORT,
                        "pages": pages, "pieces": pieces, "pieces_during_prefill": early,
                        "first_token_id": last.first_token_id if last is not None else -1}

    async def release(self, src: pb.KVSource) -> None:
        """Frees the pulled transfer on its prefill instance, once the request is admitted here (until then, a
        refusal here, e.g. a full queue, leaves it for the gateway's retry on another decode instance)."""
        try:
            await self._stub(src.address).ReleaseKV(pb.ReleaseKVRequest(transfer_id=src.transfer_id), timeout=5.0,
                                                    metadata=self._peer_metadata)
        except grpc.RpcError as e:  # its timeout releases it
            log.warning("ReleaseKV %s on %s: %s", src.transfer_id, src.address, e.code().name)
