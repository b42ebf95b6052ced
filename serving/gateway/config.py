"""The gateway's configuration file (the configuration centre), YAML or JSON: `parse_config` / `load_config` ->
`GatewayConfig` (pools, routing, isolation, long lane, admission, tenants with keys, rate limits and priorities, admin
keys, jobs, callbacks, instance TLS and key) and `ConfigWatcher`, which re-reads it when it changes and refuses a
reload that would turn authentication off or empty every pool unless the file says so. Errors never show a secret.
Format: docs/gateway.md."""
from __future__ import annotations

import base64
import binascii
import dataclasses
import ipaddress
import logging
import os
import re
from typing import Any

import yaml

from serving.api.reasoning import REASONING_PARSERS
from serving.auth import read_keys
from serving.api.tools import TOOL_PARSERS

log = logging.getLogger(__name__)

POLICIES = ("load_aware", "least_requests", "round_robin")
PRIORITY_CLASSES = ("interactive", "batch")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$")
# Tenant names a tenant may not take: admin keys act as "admin", which sees every tenant's jobs.
RESERVED_TENANT_NAMES = ("admin",)
WEBHOOK_SECRET_PREFIX = "whsec_"  # Standard Webhooks: the prefix, then the key in base64


class ConfigError(ValueError):
    """An invalid configuration; the message names the key (a dotted path) and what would be valid."""


@dataclasses.dataclass(slots=True, frozen=True)
class InstanceConfig:
    name: str
    target: str  # host:port of its meshserve.v1.Inference
    pool: str
    long_lane: bool = False
    labels: tuple[tuple[str, str], ...] = ()
    # Its KV-event stream, which then feeds its prefix affinity: "auto" (the endpoint its ModelInfo reports), a ZMQ
    # address (tcp://host:port, ipc://path), or "" (off: the gateway's guess from where it sent prompts)
    kv_events: str = ""
    # Its KV-event replay socket (ZMQ ROUTER), read when subscribing and after a gap: "" = the one its ModelInfo
    # reports when kv_events is "auto", else none; or a ZMQ address
    kv_events_replay: str = ""


@dataclasses.dataclass(slots=True, frozen=True)
class ScoreWeights:
    waiting: float = 1.0  # (waiting + requests sent since the report) / max_num_seqs
    running: float = 0.5  # running / max_num_seqs
    kv: float = 1.0  # KV-cache usage in [0, 1]
    slowness: float = 2.0  # step time relative to the fleet's median, minus 1 (0 when not slower)
    throughput: float = 0.5  # 1 - (tokens/s per running request) / the fleet's best
    affinity: float = 0.5  # subtracted: fraction of the prompt's leading blocks last sent there
    unknown: float = 0.5  # added when the instance's report is stale (its load is unknown)


@dataclasses.dataclass(slots=True, frozen=True)
class RoutingConfig:
    policy: str = "load_aware"
    load_interval_ms: int = 200  # WatchLoad interval asked of instances
    stale_after_s: float = 2.0  # a report older than this is unknown load
    weights: ScoreWeights = ScoreWeights()
    prefix_block_chars: int = 64  # text prompts: affinity index granularity (token prompts: 16 tokens)
    prefix_index_size: int = 100_000  # entries kept (LRU)


@dataclasses.dataclass(slots=True, frozen=True)
class IsolationConfig:
    enabled: bool = True
    window_s: float = 1.0
    slow_ratio: float = 3.0  # abnormal: window latency > slow_ratio x the peers' median ...
    slow_min_delta_s: float = 0.05  # ... and more than this above it (noise floor)
    abnormal_windows: int = 3  # N: consecutive abnormal windows before quarantine
    healthy_windows: int = 3  # M: consecutive healthy windows (probed) before readmission
    probe_max_tokens: int = 4
    health_check_timeout_s: float = 1.0
    silent_after_s: float = 5.0  # an instance whose load stream says nothing this long is failed (hung); 0: never


@dataclasses.dataclass(slots=True, frozen=True)
class LongLaneConfig:
    threshold_tokens: int = 0  # prompt + max_tokens above this goes to long_lane instances; 0: no lane
    max_concurrent: int = 4  # long requests running at once through this gateway
    max_queue: int = 16  # long requests waiting for a slot (RESOURCE_EXHAUSTED beyond)


@dataclasses.dataclass(slots=True, frozen=True)
class AdmissionConfig:
    max_inflight_per_instance: int = 64  # the gateway's own requests on one instance; more wait in the queue
    queue_bounds: tuple[tuple[str, int], ...] = (("interactive", 256), ("batch", 1024))
    max_tokens_cap: int = 0  # every request's max_tokens is capped to this (finish reason length); 0: none
    default_max_tokens: int = 16  # a request without max_tokens gets this (the instance's default)
    request_timeout_s: float = 600.0  # deadline for requests that bring none
    retry_pushback_ms: int = 1000

    def queue_bound(self, cls: str) -> int:
        return dict(self.queue_bounds)[cls]


@dataclasses.dataclass(slots=True, frozen=True)
class RateLimit:
    requests_per_s: float = 0.0  # 0: unlimited
    burst: int = 0  # bucket size (default: max(1, requests_per_s))
    # Tokens a request may use: its prompt + max_tokens x n, summed over its prompts; 0: unlimited
    tokens_per_s: float = 0.0
    token_burst: int = 0  # bucket size (default: 10 s of tokens_per_s); a request over it is refused outright


@dataclasses.dataclass(slots=True, frozen=True)
class TenantConfig:
    name: str
    api_keys: tuple[str, ...] = dataclasses.field(default=(), repr=False)
    priority: str = "interactive"  # the highest class its requests get (a request may ask for batch)
    pools: tuple[str, ...] = ()  # preference order; spill-over to the next when one is full; () = all pools
    rate_limit: RateLimit = RateLimit()
    max_inflight: int = 0  # its requests at the gateway at once (queued or running); more: RESOURCE_EXHAUSTED; 0: none
    webhook_secret: str = dataclasses.field(default="", repr=False)  # whsec_<base64>: signs its job callbacks
    # LoRA adapters its requests may name (docs/lora.md); None: any the instances serve; (): the base model only
    adapters: tuple[str, ...] | None = None


@dataclasses.dataclass(slots=True, frozen=True)
class CallbackConfig:
    allowed_hosts: tuple[str, ...] = ()  # host names or IP literals a callback URL may name
    allowed_ports: tuple[int, ...] = (80, 443)
    # Loopback, private and link-local addresses are refused unless in one of these networks (or the URL names an
    # IP literal listed in allowed_hosts)
    allowed_networks: tuple[str, ...] = ()
    retry_window_s: float = 3600.0  # deliveries are retried (with backoff) this long after the job ends
    retry_initial_s: float = 1.0  # the first retry's wait; it doubles up to retry_max_s
    retry_max_s: float = 300.0
    timeout_s: float = 10.0  # one delivery attempt, connection to last byte
    max_concurrent: int = 16  # deliveries in flight at once
    webhook_secret: str = dataclasses.field(default="", repr=False)  # for tenants without their own (and auth off)


@dataclasses.dataclass(slots=True, frozen=True)
class JobsConfig:
    max_crashes: int = 3  # a job that was running when the gateway died this many times fails instead of rerunning
    retention_s: float = 7 * 86400.0  # finished jobs (and their idempotency keys) are deleted this long after


@dataclasses.dataclass(slots=True, frozen=True)
class DisaggregationConfig:
    """Prefill/decode disaggregation (docs/disaggregation.md): n = 1 requests are prefilled on an instance of
    `prefill_pools` (--role=prefill) and continued on one of `decode_pools` (--role=decode); none: off."""
    prefill_pools: tuple[str, ...] = ()
    decode_pools: tuple[str, ...] = ()

    @property
    def enabled(self) -> bool:
        return bool(self.prefill_pools)


@dataclasses.dataclass(slots=True, frozen=True)
class GatewayConfig:
    pools: tuple[str, ...] = ()
    instances: tuple[InstanceConfig, ...] = ()
    routing: RoutingConfig = RoutingConfig()
    isolation: IsolationConfig = IsolationConfig()
    long_lane: LongLaneConfig = LongLaneConfig()
    admission: AdmissionConfig = AdmissionConfig()
    tenants: tuple[TenantConfig, ...] = ()  # none: auth off, requests name their tenant
    admin_keys: tuple[str, ...] = dataclasses.field(default=(), repr=False)
    callbacks: CallbackConfig = CallbackConfig()
    jobs: JobsConfig = JobsConfig()
    # A reload may turn authentication off, or leave no instance, only when the file says so (else it is refused)
    allow_unauthenticated: bool = False
    allow_no_instances: bool = False
    tokenizer: str = ""  # optional tokenizer directory: exact prompt lengths for the long lane
    instance_tls: tuple[tuple[str, str], ...] = ()  # ca / cert / key files for (mutual) TLS to instances
    instance_key_file: str = ""  # the key the gateway sends to its instances (their --api_key_file); re-read on change
    # The key of the gateway's admin calls to instances (their --admin_key_file): LoRA adapter loads and unloads
    instance_admin_key_file: str = ""
    # The chat parsers of the HTTP API (serving.api.tools / serving.api.reasoning); "": the instances' (ModelInfo)
    tool_call_parser: str = ""
    reasoning_parser: str = ""
    disaggregation: DisaggregationConfig = DisaggregationConfig()

    @property
    def auth_enabled(self) -> bool:
        return bool(self.tenants or self.admin_keys)


def _section(raw: dict, key: str) -> dict:
    value = raw.get(key) or {}
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__}")
    return value


def _build(cls, raw: dict, path: str, **fixed):
    """cls(**raw) with unknown keys and wrong types named."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping, got {type(raw).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kw = dict(fixed)
    for key, value in raw.items():
        if key not in fields or key in fixed:
            known = sorted(set(fields) - set(fixed))
            raise ConfigError(f"{path}.{key}: unknown key; known: {', '.join(known)}")
        # A secret (a field kept out of reprs): its errors say what type it is, never what it is.
        shown = repr(value) if fields[key].repr else f"a {type(value).__name__} (not shown: a secret)"
        default = fields[key].default
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise ConfigError(f"{path}.{key}: expected true or false, got {shown}")
        elif isinstance(default, int) and not isinstance(default, bool):
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"{path}.{key}: expected an integer, got {shown}")
        elif isinstance(default, float):
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ConfigError(f"{path}.{key}: expected a number, got {shown}")
            value = float(value)
        elif (isinstance(default, str) or fields[key].type in ("str", str)) and not isinstance(value, str):
            raise ConfigError(f"{path}.{key}: expected a string, got {shown}")
        kw[key] = value
    for key, f in fields.items():  # a required key (no default) left out
        if key not in kw and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{path}.{key}: required")
    return cls(**kw)


def _positive(path: str, value, *, zero_ok: bool = False) -> None:
    if value < 0 or (value == 0 and not zero_ok):
        raise ConfigError(f"{path}: must be {'>= 0' if zero_ok else '> 0'}, got {value}")


def _str_list(raw, path: str, *, secret: bool = False) -> tuple[str, ...]:
    if raw is None:
        return ()
    if isinstance(raw, str) or not isinstance(raw, list) or not all(isinstance(x, str) and x for x in raw):
        shown = f"a {type(raw).__name__} (not shown: keys are secrets)" if secret else repr(raw)
        raise ConfigError(f"{path}: expected a list of non-empty strings, got {shown}")
    return tuple(raw)


_TOP_LEVEL_KEYS = {"pools", "routing", "isolation", "long_lane", "admission", "tenants", "admin_keys", "callbacks",
                   "jobs", "tokenizer", "instance_tls", "instance_key_file", "instance_admin_key_file",
                   "tool_call_parser", "reasoning_parser", "allow_unauthenticated", "allow_no_instances",
                   "disaggregation"}


def parse_config(raw: Any) -> GatewayConfig:
    """A GatewayConfig from the file's parsed contents; raises ConfigError naming the bad key. The sections are read
    in a fixed order, so of several errors the first section's is the one raised."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"(top level): expected a mapping, got {type(raw).__name__}")
    for key in raw:
        if key not in _TOP_LEVEL_KEYS:
            raise ConfigError(f"{key}: unknown key; known: {', '.join(sorted(_TOP_LEVEL_KEYS))}")
    pools, instances = _pools(raw.get("pools") or [])
    routing = _routing(_section(raw, "routing"))
    iso = _isolation(_section(raw, "isolation"))
    lane = _long_lane(_section(raw, "long_lane"), instances)
    adm = _admission(_section(raw, "admission"))
    tenants, admin_keys = _tenants(raw, pools)
    callbacks = _callbacks(_section(raw, "callbacks"))
    jobs = _jobs(_section(raw, "jobs"))
    flags = _allow_flags(raw)
    tls = _instance_tls(raw.get("instance_tls") or {})
    key_files = _key_files(raw)
    tokenizer = raw.get("tokenizer") or ""
    if not isinstance(tokenizer, str):
        raise ConfigError("tokenizer: expected a directory path")
    parsers = _chat_parsers(raw)
    disagg = _disaggregation(_section(raw, "disaggregation"), pools)
    return GatewayConfig(pools=tuple(pools), instances=tuple(instances), routing=routing, isolation=iso,
                         long_lane=lane, admission=adm, tenants=tuple(tenants), admin_keys=admin_keys,
                         callbacks=callbacks, jobs=jobs, tokenizer=tokenizer, instance_tls=tuple(sorted(tls.items())),
                         disaggregation=disagg, **key_files, **parsers, **flags)


def _pools(pools_raw) -> tuple[list[str], list[InstanceConfig]]:
    """The pool names and their instances; names and targets unique over every pool."""
    if not isinstance(pools_raw, list):
        raise ConfigError("pools: expected a list of {name, instances}")
    pools, instances, names, targets = [], [], set(), set()
    for i, p in enumerate(pools_raw):
        if not isinstance(p, dict) or not isinstance(p.get("name"), str) or not _NAME.match(p["name"]):
            raise ConfigError(f"pools[{i}].name: expected a name of letters, digits, _ . : -")
        if set(p) - {"name", "instances"}:
            raise ConfigError(f"pools[{i}].{sorted(set(p) - {'name', 'instances'})[0]}: unknown key; known: "
                              "name, instances")
        if p["name"] in pools:
            raise ConfigError(f"pools[{i}].name: {p['name']!r} is defined twice")
        pools.append(p["name"])
        for j, inst in enumerate(p.get("instances") or []):
            ic = _instance(inst, f"pools[{i}].instances[{j}]", p["name"], names, targets)
            names.add(ic.name)
            targets.add(ic.target)
            instances.append(ic)
    return pools, instances


def _instance(inst, path: str, pool: str, names: set[str], targets: set[str]) -> InstanceConfig:
    if not isinstance(inst, dict):
        raise ConfigError(f"{path}: expected a mapping with name and target")
    labels = inst.get("labels") or {}
    if not isinstance(labels, dict):
        raise ConfigError(f"{path}.labels: expected a mapping")
    ic = _build(InstanceConfig, {k: v for k, v in inst.items() if k != "labels"}, path, pool=pool,
                labels=tuple(sorted((str(k), str(v)) for k, v in labels.items())))
    if not _NAME.match(ic.name or ""):
        raise ConfigError(f"{path}.name: expected a name of letters, digits, _ . : -, got {ic.name!r}")
    if ic.name in names:
        raise ConfigError(f"{path}.name: instance {ic.name!r} is defined twice")
    if not re.match(r"^[^\s:]+:\d+$", ic.target or ""):
        raise ConfigError(f"{path}.target: expected host:port, got {ic.target!r}")
    if ic.kv_events and ic.kv_events != "auto" and not re.match(r"^(tcp://[^\s:]+:\d+|ipc://\S+)$", ic.kv_events):
        raise ConfigError(f"{path}.kv_events: expected auto, tcp://host:port or ipc://path, got {ic.kv_events!r}")
    if ic.kv_events_replay and not re.match(r"^(tcp://[^\s:]+:\d+|ipc://\S+)$", ic.kv_events_replay):
        raise ConfigError(f"{path}.kv_events_replay: expected tcp://host:port or ipc://path, got "
                          f"{ic.kv_events_replay!r}")
    if ic.target in targets:
        raise ConfigError(f"{path}.target: {ic.target} is listed twice")
    return ic


def _routing(r: dict) -> RoutingConfig:
    weights = _build(ScoreWeights, r.get("weights") or {}, "routing.weights")
    routing = _build(RoutingConfig, {k: v for k, v in r.items() if k != "weights"}, "routing", weights=weights)
    if routing.policy not in POLICIES:
        raise ConfigError(f"routing.policy: {routing.policy!r}; use one of {', '.join(POLICIES)}")
    _positive("routing.load_interval_ms", routing.load_interval_ms)
    if routing.load_interval_ms < 10:
        raise ConfigError(f"routing.load_interval_ms: at least 10, got {routing.load_interval_ms}")
    _positive("routing.stale_after_s", routing.stale_after_s)
    _positive("routing.prefix_block_chars", routing.prefix_block_chars)
    _positive("routing.prefix_index_size", routing.prefix_index_size)
    return routing


def _isolation(raw: dict) -> IsolationConfig:
    iso = _build(IsolationConfig, raw, "isolation")
    _positive("isolation.window_s", iso.window_s)
    if iso.slow_ratio < 1:
        raise ConfigError(f"isolation.slow_ratio: must be >= 1, got {iso.slow_ratio}")
    _positive("isolation.slow_min_delta_s", iso.slow_min_delta_s, zero_ok=True)
    _positive("isolation.abnormal_windows", iso.abnormal_windows)
    _positive("isolation.healthy_windows", iso.healthy_windows)
    _positive("isolation.probe_max_tokens", iso.probe_max_tokens)
    _positive("isolation.silent_after_s", iso.silent_after_s, zero_ok=True)
    return iso


def _long_lane(raw: dict, instances: list[InstanceConfig]) -> LongLaneConfig:
    lane = _build(LongLaneConfig, raw, "long_lane")
    _positive("long_lane.threshold_tokens", lane.threshold_tokens, zero_ok=True)
    _positive("long_lane.max_concurrent", lane.max_concurrent)
    _positive("long_lane.max_queue", lane.max_queue, zero_ok=True)
    if lane.threshold_tokens and not any(i.long_lane for i in instances):
        raise ConfigError("long_lane.threshold_tokens: set, but no instance has long_lane: true")
    return lane


def _admission(raw: dict) -> AdmissionConfig:
    a = dict(raw)
    bounds = a.pop("queue_bounds", None) or {}
    if not isinstance(bounds, dict) or set(bounds) - set(PRIORITY_CLASSES):
        raise ConfigError(f"admission.queue_bounds: expected a mapping of {', '.join(PRIORITY_CLASSES)} to sizes")
    merged = dict(AdmissionConfig().queue_bounds)
    for k, v in bounds.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ConfigError(f"admission.queue_bounds.{k}: expected an integer >= 0, got {v!r}")
        merged[k] = v
    adm = _build(AdmissionConfig, a, "admission", queue_bounds=tuple(merged.items()))
    _positive("admission.max_inflight_per_instance", adm.max_inflight_per_instance)
    _positive("admission.max_tokens_cap", adm.max_tokens_cap, zero_ok=True)
    _positive("admission.default_max_tokens", adm.default_max_tokens)
    _positive("admission.request_timeout_s", adm.request_timeout_s)
    return adm


def _tenants(raw: dict, pools: list[str]) -> tuple[list[TenantConfig], tuple[str, ...]]:
    """The tenants and the admin keys: every key belongs to one tenant or to the admins."""
    tenants, keys = [], {}
    tenants_raw = raw.get("tenants") or []
    if not isinstance(tenants_raw, list):
        raise ConfigError("tenants: expected a list of {name, api_keys, priority, pools, rate_limit}")
    admin_keys = _str_list(raw.get("admin_keys"), "admin_keys", secret=True)
    for i, t in enumerate(tenants_raw):
        tc = _tenant(t, f"tenants[{i}]", pools, tenants)
        for k in tc.api_keys:
            if k in keys or k in admin_keys:
                raise ConfigError(f"tenants[{i}].api_keys: a key is listed twice (also for {keys.get(k, 'admin')})")
            keys[k] = tc.name
        tenants.append(tc)
    return tenants, admin_keys


def _tenant(t, path: str, pools: list[str], earlier: list[TenantConfig]) -> TenantConfig:
    if not isinstance(t, dict):
        raise ConfigError(f"{path}: expected a mapping")
    t = dict(t)
    rl = _build(RateLimit, t.pop("rate_limit", None) or {}, f"{path}.rate_limit")
    _positive(f"{path}.rate_limit.requests_per_s", rl.requests_per_s, zero_ok=True)
    _positive(f"{path}.rate_limit.burst", rl.burst, zero_ok=True)
    _positive(f"{path}.rate_limit.tokens_per_s", rl.tokens_per_s, zero_ok=True)
    _positive(f"{path}.rate_limit.token_burst", rl.token_burst, zero_ok=True)
    api_keys = _str_list(t.pop("api_keys", None), f"{path}.api_keys", secret=True)
    tpools = _str_list(t.pop("pools", None), f"{path}.pools")
    tadapters = _str_list(t.pop("adapters"), f"{path}.adapters") if "adapters" in t else None
    tc = _build(TenantConfig, t, path, api_keys=api_keys, pools=tpools, rate_limit=rl, adapters=tadapters)
    if not _NAME.match(tc.name or ""):
        raise ConfigError(f"{path}.name: expected a name of letters, digits, _ . : -, got {tc.name!r}")
    if tc.name.lower() in RESERVED_TENANT_NAMES:
        raise ConfigError(f"{path}.name: {tc.name!r} is reserved (admin keys act as it); choose another name")
    if tc.name in {x.name for x in earlier}:
        raise ConfigError(f"{path}.name: tenant {tc.name!r} is defined twice")
    _positive(f"{path}.max_inflight", tc.max_inflight, zero_ok=True)
    if tc.webhook_secret:
        webhook_key(tc.webhook_secret, f"{path}.webhook_secret")
    if tc.priority not in PRIORITY_CLASSES:
        raise ConfigError(f"{path}.priority: {tc.priority!r}; use one of {', '.join(PRIORITY_CLASSES)}")
    for p in tpools:
        if p not in pools:
            raise ConfigError(f"{path}.pools: unknown pool {p!r}; pools: {', '.join(pools)}")
    return tc


def _jobs(raw: dict) -> JobsConfig:
    jobs = _build(JobsConfig, raw, "jobs")
    _positive("jobs.max_crashes", jobs.max_crashes)
    _positive("jobs.retention_s", jobs.retention_s)
    return jobs


def _allow_flags(raw: dict) -> dict[str, bool]:
    flags = {}
    for key in ("allow_unauthenticated", "allow_no_instances"):
        flags[key] = raw.get(key, False)
        if not isinstance(flags[key], bool):
            raise ConfigError(f"{key}: expected true or false, got {flags[key]!r}")
    return flags


def _instance_tls(tls) -> dict[str, str]:
    if not isinstance(tls, dict) or set(tls) - {"ca", "cert", "key"}:
        raise ConfigError("instance_tls: expected a mapping with ca, and cert + key for mutual TLS")
    if ("cert" in tls) != ("key" in tls):
        raise ConfigError("instance_tls: cert and key go together")
    for k, v in tls.items():
        if not isinstance(v, str) or not os.path.isfile(v):
            raise ConfigError(f"instance_tls.{k}: not a readable file: {v!r}")
    return tls


def _key_files(raw: dict) -> dict[str, str]:
    key_files = {}
    for key in ("instance_key_file", "instance_admin_key_file"):
        key_files[key] = raw.get(key) or ""
        if not isinstance(key_files[key], str):
            raise ConfigError(f"{key}: expected a file path, got a {type(key_files[key]).__name__}")
        if key_files[key]:
            try:
                read_keys(key_files[key], key)  # its errors name the file and line, not the key
            except ValueError as e:
                raise ConfigError(str(e)) from None
    return key_files


def _chat_parsers(raw: dict) -> dict[str, str]:
    parsers = {}
    for key, known_names in (("tool_call_parser", TOOL_PARSERS), ("reasoning_parser", REASONING_PARSERS)):
        parsers[key] = raw.get(key) or ""
        if parsers[key] and parsers[key] not in known_names:
            raise ConfigError(f"{key}: unknown {parsers[key]!r}; known: {', '.join(sorted(known_names))}")
    return parsers


def _disaggregation(d: dict, pools: list[str]) -> DisaggregationConfig:
    if set(d) - {"prefill_pools", "decode_pools"}:
        raise ConfigError(f"disaggregation.{sorted(set(d) - {'prefill_pools', 'decode_pools'})[0]}: unknown key; "
                          "known: prefill_pools, decode_pools")
    disagg = DisaggregationConfig(_str_list(d.get("prefill_pools"), "disaggregation.prefill_pools"),
                                  _str_list(d.get("decode_pools"), "disaggregation.decode_pools"))
    if bool(disagg.prefill_pools) != bool(disagg.decode_pools):
        raise ConfigError("disaggregation: prefill_pools and decode_pools go together (both non-empty)")
    for key, names in (("prefill_pools", disagg.prefill_pools), ("decode_pools", disagg.decode_pools)):
        for name in names:
            if name not in pools:
                raise ConfigError(f"disaggregation.{key}: unknown pool {name!r}; pools: {', '.join(pools)}")
    if set(disagg.prefill_pools) & set(disagg.decode_pools):
        raise ConfigError("disaggregation: a pool is both a prefill and a decode pool")
    return disagg


def webhook_key(secret: str, path: str) -> bytes:
    """The signing key of a Standard Webhooks secret (`whsec_` + base64 of 16 to 64 random bytes). The error names
    the key's path, never the secret."""
    if not secret.startswith(WEBHOOK_SECRET_PREFIX):
        raise ConfigError(f"{path}: expected {WEBHOOK_SECRET_PREFIX}<base64 of 16 to 64 random bytes>, e.g. "
                          "`echo whsec_$(head -c 32 /dev/urandom | base64)`")
    try:
        key = base64.b64decode(secret[len(WEBHOOK_SECRET_PREFIX):], validate=True)
    except (binascii.Error, ValueError):
        raise ConfigError(f"{path}: the part after {WEBHOOK_SECRET_PREFIX} is not base64") from None
    if not 16 <= len(key) <= 64:
        raise ConfigError(f"{path}: a key of {len(key)} bytes; 16 to 64 are valid")
    return key


def _callbacks(cb: dict) -> CallbackConfig:
    cb = dict(cb)
    hosts = []
    for h in _str_list(cb.pop("allowed_hosts", None), "callbacks.allowed_hosts"):
        h = h.lower().strip("[]")
        if not re.match(r"^[a-z0-9.:_-]+$", h):
            raise ConfigError(f"callbacks.allowed_hosts: {h!r} is not a host name or an IP address")
        try:
            h = str(ipaddress.ip_address(h))  # one spelling per address
        except ValueError:
            pass
        hosts.append(h)
    hosts = tuple(hosts)
    ports = cb.pop("allowed_ports", None)
    if ports is not None and (not isinstance(ports, list) or not all(
            isinstance(p, int) and not isinstance(p, bool) and 0 < p < 65536 for p in ports)):
        raise ConfigError(f"callbacks.allowed_ports: expected a list of ports (1-65535), got {ports!r}")
    networks = _str_list(cb.pop("allowed_networks", None), "callbacks.allowed_networks")
    for n in networks:
        try:
            ipaddress.ip_network(n, strict=False)
        except ValueError:
            raise ConfigError(f"callbacks.allowed_networks: {n!r} is not a network (e.g. 10.0.0.0/8)") from None
    out = _build(CallbackConfig, cb, "callbacks", allowed_hosts=hosts, allowed_networks=networks,
                 **({} if ports is None else {"allowed_ports": tuple(ports)}))
    for key in ("retry_window_s", "retry_initial_s", "retry_max_s", "timeout_s", "max_concurrent"):
        _positive(f"callbacks.{key}", getattr(out, key))
    if out.webhook_secret:
        webhook_key(out.webhook_secret, "callbacks.webhook_secret")
    return out


def check_reload(old: GatewayConfig, new: GatewayConfig) -> None:
    """ConfigError when `new` would fail open after `old`: authentication on -> off, or instances -> none (an empty
    or half-written file), unless `new` says so (allow_unauthenticated, allow_no_instances)."""
    if old.auth_enabled and not new.auth_enabled and not new.allow_unauthenticated:
        raise ConfigError("tenants, admin_keys: none left, which would turn authentication off; keeping the running "
                          "configuration (set allow_unauthenticated: true to mean it)")
    if old.instances and not new.instances and not new.allow_no_instances:
        raise ConfigError("pools: no instance left in any pool; keeping the running configuration (set "
                          "allow_no_instances: true to mean it)")


def load_config(path: str) -> GatewayConfig:
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML/JSON: {e}") from e
    return parse_config(raw)


class ConfigWatcher:
    """Holds the current configuration and re-reads the file when it changes (`poll`, called periodically)."""

    def __init__(self, path: str):
        self.path = path
        self.config = load_config(path)  # the first file must be valid
        if not self.config.auth_enabled:
            log.warning("configuration %s has no tenants and no admin keys: authentication is off, every caller "
                        "names its own tenant and may use the admin RPCs", path)
        self.version = 1
        self.last_error = ""
        self._stamp = self._file_stamp()

    def _file_stamp(self):
        try:
            st = os.stat(self.path)
            return (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError:
            return None

    def poll(self, force: bool = False) -> bool:
        """Reloads if the file changed (or `force`); True when a new configuration was applied."""
        stamp = self._file_stamp()
        if not force and stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            config = load_config(self.path)
            check_reload(self.config, config)
        except ConfigError as e:
            self.last_error = str(e)
            log.error("configuration %s rejected, keeping version %d: %s", self.path, self.version, e)
            return False
        self.last_error = ""
        if config == self.config:
            return False
        self.config = config
        self.version += 1
        log.info("configuration %s applied (version %d): %d pools, %d instances, policy %s", self.path,
                 self.version, len(config.pools), len(config.instances), config.routing.policy)
        return True
