"""`ServerConfig`: the instance server's own settings (ports, TLS, keys, drain, limits, tracing, the HTTP API's model
name and tool-call parser), each field also the server's flag of its name (serving.config_flags); light to import, so the
flags are defined without loading the server."""
from __future__ import annotations

import dataclasses

from serving.api.guard import HttpLimits
from serving.api.tools import TOOL_PARSERS
from serving.config_flags import option
from serving.transport import MAX_CONCURRENT_STREAMS


@dataclasses.dataclass(slots=True)
class ServerConfig:
    # A field made with `option` is also the server's flag of that name (serving.config_flags); its help is the flag's.
    # Loopback unless told otherwise: an instance open to the network is a choice (with keys: docs/security.md).
    host: str = option("127.0.0.1", "Address to listen on (gRPC, HTTP, metrics); 0.0.0.0: every interface (with "
                       "--api_key_file: docs/security.md).")
    port: int = option(50051, "gRPC port; 0: any free port.")
    metrics_port: int = option(9090, "Prometheus port; 0: any free port; -1: none.")
    warmup: bool = option(True, "Compile every bucket before SERVING (never turn off in production).")
    drain_grace_s: float = option(30.0, "On SIGTERM: how long accepted requests may take to finish.")
    max_request_bytes: int = option(1 << 20, "Largest GenerateRequest accepted (INVALID_ARGUMENT beyond).")
    retry_after_s: float = option(1.0, "Retry hint sent with RESOURCE_EXHAUSTED.")
    instance_id: str = option("", "Name in load reports (default host:pid).")
    otlp_endpoint: str = option("", "OTLP/gRPC collector for traces (host:port); empty: no tracing.")
    service_name: str = option("meshserve", "service.name of the traces.")
    ready_file: str = option(
        "", "Written (JSON: port, metrics_port, http_port with --http_port, pid) once the server is SERVING.")
    tls_cert: str = option("", "PEM certificate chain: serve TLS (with --tls_key).")
    tls_key: str = option("", "PEM private key for --tls_cert.")
    tls_client_ca: str = option("", "PEM CA: require client certificates signed by it (mutual TLS).")
    http_port: int = option(
        -1, "OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models, /health, /tokenize, "
        "/detokenize) on this port, beside gRPC; 0: any free port (reported in --ready_file); -1: off.")
    served_model_name: str = option(
        "", "The model's name in the HTTP API (requests naming another get 404) and in metrics; default: the --model "
        "directory's name.")
    tool_call_parser: str = option(
        "", "The format of the model's tool calls, parsed into OpenAI tool_calls; empty: the one its chat template "
        "shows (<tool_call>: hermes, [TOOL_CALLS]: mistral, <|python_tag|>: llama3_json), else none.",
        choices=("",) + tuple(TOOL_PARSERS))
    api_key_file: str = option(
        "", "Keys (one a line, >= 16 characters, re-read when the file changes) every caller must send as "
        "`authorization: Bearer <key>`, except health checks; empty: no key needed.")
    admin_key_file: str = option(
        "", "Keys for Drain and GetLoad(check_invariants) (a regular key gets PERMISSION_DENIED); empty: with "
        "--api_key_file nobody may call them, without it anyone.")
    max_concurrent_streams: int = option(MAX_CONCURRENT_STREAMS, "gRPC streams at once per client connection.")
    trace_content: bool = option(False, "Trace span events carry the generated token ids.")
    otlp_ca_file: str = option("", "PEM CA of the OTLP collector: export over TLS; empty: plaintext.")
    http_header_timeout_s: float = option(
        10.0, "HTTP: a connection whose request headers are not complete this long after it opened (or after its "
        "last response) is closed (slow-header clients).")
    http_body_timeout_s: float = option(60.0, "HTTP: a request body not complete this long after its headers: 408.")
    http_max_connections: int = option(
        1024, "HTTP: past this many open connections (or running requests) a new request gets 503 at once.")
    lora_root: str = option(
        "", "With --enable_lora: the directory under which adapters may be loaded at run time (POST "
        "/v1/load_lora_adapter, LoadLoRAAdapter; admin key); empty: run-time loading is off (docs/lora.md).")
    role: str = option(
        "both", "Prefill/decode disaggregation (docs/disaggregation.md): prefill (computes prompts' KV and first token "
        "for kv_export requests, holds the pages for a decode instance to pull), decode (continues kv_source requests "
        "from pulled pages), both (neither: today's instance).", choices=("both", "prefill", "decode"))
    kv_transfer_timeout_s: float = option(
        30.0, "--role=prefill: pages held for a transfer are released this long after the prefill ended if no "
        "decode instance pulled and released them.")
    kv_peer_key_file: str = option(
        "", "--role=decode: the key (first line) sent to prefill instances when pulling pages (their --api_key_file "
        "must list it: the gateway's instance key); empty: none.")
    kv_peer_ca_file: str = option(
        "", "--role=decode: PEM CA of the prefill instances' TLS certificates: pull over TLS, with --tls_cert / "
        "--tls_key as the client certificate (for their --tls_client_ca); empty: plaintext.")

    def __post_init__(self):
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be >= 1024, got {self.max_request_bytes}")
        if bool(self.tls_cert) != bool(self.tls_key) or (self.tls_client_ca and not self.tls_cert):
            raise ValueError("TLS: tls_cert and tls_key go together; tls_client_ca needs them")
        if self.kv_transfer_timeout_s <= 0:
            raise ValueError(f"kv_transfer_timeout_s must be > 0, got {self.kv_transfer_timeout_s}")
        if self.drain_grace_s < 0:
            raise ValueError(f"drain_grace_s must be >= 0, got {self.drain_grace_s}")
        HttpLimits(self.http_header_timeout_s, self.http_body_timeout_s, self.http_max_connections)  # checks them
        if self.max_concurrent_streams < 1:
            raise ValueError(f"max_concurrent_streams must be >= 1, got {self.max_concurrent_streams}")
