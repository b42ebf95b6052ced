"""`GatewayAdapters`: the LoRA adapters loaded through the gateway (name -> PEFT directory, as the instances read it),
registered on every instance with LoRA on at load time and on instances that join or come back later (from their
load reports); unloaded everywhere. Each instance puts an adapter in a device slot when a request for it lands there."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import grpc

from serving.auth import KeyFile
from serving.gateway.pools import Instance
from serving.wire import meshserve_pb2 as pb

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 60.0  # a load reads the adapter's config and safetensors header on the instance's engine thread
REPORT_WAIT_S = 5.0  # a load or unload answers once the instances' load reports show it (routing follows them)
RETRY_S = 5.0  # an instance that lacks a registered adapter is asked again no sooner than this
# An instance that is down or restarting: skipped now, loaded from its load reports when it serves again.
UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


class AdapterError(Exception):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class GatewayAdapters:
    """Loads and unloads adapters on the instances `instances()` returns (the routable ones), with the key of
    `key_path()` (the configuration's instance_admin_key_file; empty: each instance's regular metadata)."""

    def __init__(self, instances: Callable[[], list[Instance]], key_path: Callable[[], str]):
        self.registry: dict[str, str] = {}  # name -> path, in load order
        self._instances = instances
        self._key_path = key_path
        self._key_file: KeyFile | None = None
        self._lock = asyncio.Lock()  # one load or unload at a time: each sees the other's result
        self._tried: dict[tuple[str, str], float] = {}  # (instance, adapter) -> when the gateway last loaded it
        self._tasks: set[asyncio.Task] = set()

    def _metadata(self, inst: Instance) -> list[tuple[str, str]]:
        path = self._key_path()
        if not path:
            return inst.metadata()
        if self._key_file is None or self._key_file.path != path:
            self._key_file = KeyFile(path, "instance_admin_key_file")
        return [("authorization", f"Bearer {self._key_file.first()}")]

    def _lora_instances(self) -> list[Instance]:
        """The routable instances with LoRA on (their load report's max_loras), by name."""
        return sorted((i for i in self._instances() if i.report is not None and i.report.max_loras > 0),
                      key=lambda i: i.name)

    async def _call(self, inst: Instance, method: str, request):
        return await getattr(inst.stub, method)(request, timeout=CALL_TIMEOUT_S, metadata=self._metadata(inst))

    async def load(self, name: str, path: str) -> pb.LoRAAdapterResponse:
        """Registers `name` on every instance with LoRA on; all or none: an instance's refusal (the path outside its
        --lora_root, an adapter that does not fit, a taken name) unloads it from the others and is raised with
        the instance's status and message. Instances that cannot be reached get it once they serve again."""
        if not name:
            raise AdapterError(grpc.StatusCode.INVALID_ARGUMENT, "lora_name: empty; name the adapter")
        if not path:
            raise AdapterError(grpc.StatusCode.INVALID_ARGUMENT, "lora_path: empty; give the adapter's directory")
        async with self._lock:
            if name in self.registry:
                raise AdapterError(grpc.StatusCode.INVALID_ARGUMENT, f"lora_name: {name!r} is already loaded (from "
                                   f"{self.registry[name]!r}); unload it first")
            targets = self._lora_instances()
            if not targets:
                raise AdapterError(grpc.StatusCode.UNAVAILABLE, "no serving instance has LoRA on (--enable_lora); "
                                   "nothing to load the adapter on")
            request = pb.LoadLoRAAdapterRequest(lora_name=name, lora_path=path)
            results = await asyncio.gather(*(self._call(i, "LoadLoRAAdapter", request) for i in targets),
                                           return_exceptions=True)
            loaded = [(i, r) for i, r in zip(targets, results) if isinstance(r, pb.LoRAAdapterResponse)]
            errors = [(i, r) for i, r in zip(targets, results) if not isinstance(r, pb.LoRAAdapterResponse)]
            refused = [(i, e) for i, e in errors if not isinstance(e, grpc.RpcError) or e.code() not in UNREACHABLE]
            if refused or not loaded:
                await self._unload_on([i for i, _ in loaded], name)
                inst, e = (refused or errors)[0]
                if not isinstance(e, grpc.RpcError):
                    raise e
                code = e.code() if refused else grpc.StatusCode.UNAVAILABLE
                raise AdapterError(code, f"instance {inst.name!r}: {e.details()}")
            self.registry[name] = path
            now = time.monotonic()
            for inst, _ in errors:  # unreachable now: the next load reports retry it
                log.warning("LoRA adapter %r: instance %s unreachable; loading it there when it serves", name,
                            inst.name)
            for inst, _ in loaded:
                self._tried[(inst.name, name)] = now
            await self._reported([i for i, _ in loaded], lambda r: name in r.lora_adapters)
            log.info("LoRA adapter %r (%s) loaded on %s", name, path, ", ".join(i.name for i, _ in loaded))
            return loaded[0][1]

    async def unload(self, name: str) -> int:
        """Unregisters `name` and unloads it from every instance serving it; returns the requests still in flight
        on it (they finish on it). NOT_FOUND naming the loaded adapters when neither the gateway nor an instance
        has it; an instance's refusal is raised with its status and message (after the others unloaded it)."""
        async with self._lock:
            instances = self._lora_instances()
            if name not in self.registry and not any(name in i.report.lora_adapters for i in instances):
                known = sorted(set(self.registry) | {a for i in instances for a in i.report.lora_adapters})
                raise AdapterError(grpc.StatusCode.NOT_FOUND, f"lora_name: LoRA adapter {name!r} is not loaded "
                                   f"(loaded: {', '.join(known) or 'none'})")
            self.registry.pop(name, None)
            results = await self._unload_on(instances, name)
            refused = [(i, e) for i, e in zip(instances, results) if isinstance(e, Exception)
                       and (not isinstance(e, grpc.RpcError) or e.code() not in UNREACHABLE + (
                           grpc.StatusCode.NOT_FOUND,))]
            await self._reported(instances, lambda r: name not in r.lora_adapters)
            if refused:
                inst, e = refused[0]
                if not isinstance(e, grpc.RpcError):
                    raise e
                raise AdapterError(e.code(), f"instance {inst.name!r}: {e.details()}")
            log.info("LoRA adapter %r unloaded", name)
            return sum(r.requests_in_flight for r in results if isinstance(r, pb.LoRAAdapterResponse))

    async def _unload_on(self, instances: list[Instance], name: str) -> list:
        request = pb.UnloadLoRAAdapterRequest(lora_name=name)
        return await asyncio.gather(*(self._call(i, "UnloadLoRAAdapter", request) for i in instances),
                                    return_exceptions=True)

    async def _reported(self, instances: list[Instance], done: Callable[[pb.LoadReport], bool]) -> None:
        """Waits (up to REPORT_WAIT_S) until each instance's latest load report satisfies `done`."""
        deadline = time.monotonic() + REPORT_WAIT_S
        while time.monotonic() < deadline and not all(i.report is None or done(i.report) for i in instances):
            await asyncio.sleep(0.02)

    def on_report(self, inst: Instance) -> None:
        """An instance's load report: loads the registered adapters it lacks (it joined, restarted or was down at
        the load), at most once per RETRY_S each."""
        r = inst.report
        if not self.registry or r is None or r.max_loras == 0 or not r.serving:
            return
        now = time.monotonic()
        for name, path in list(self.registry.items()):
            if name in r.lora_adapters or now - self._tried.get((inst.name, name), -RETRY_S) < RETRY_S:
                continue
            self._tried[(inst.name, name)] = now
            task = asyncio.ensure_future(self._load_one(inst, name, path))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _load_one(self, inst: Instance, name: str, path: str) -> None:
        async with self._lock:
            if self.registry.get(name) != path or (inst.report is not None and name in inst.report.lora_adapters):
                return  # unloaded (or loaded again from elsewhere) meanwhile, or there already
            try:
                await self._call(inst, "LoadLoRAAdapter", pb.LoadLoRAAdapterRequest(lora_name=name, lora_path=path))
                log.info("LoRA adapter %r loaded on instance %s (it lacked it)", name, inst.name)
            except grpc.RpcError as e:
                log.warning("LoRA adapter %r: instance %s refused it: %s: %s", name, inst.name, e.code().name,
                            e.details())

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
