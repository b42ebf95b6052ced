"""Prometheus metrics of the gateway (prefix `meshserve:gateway_`): the server's request metrics (requests by
code, TTFT, e2e) as clients see them through the gateway, plus per-instance routing counts, states and
quarantine events, pool usage, queue depths, retries, rate limiting, config reloads and jobs."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from serving.telemetry.metrics import REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS

PREFIX = "meshserve:gateway_"
STATES = ("healthy", "quarantined", "failed", "drained")


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        self.requests = Counter(PREFIX + "requests", "Generate requests finished, by gRPC status code.", ["code"],
                                registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token through the gateway.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "End-to-end latency through the gateway.",
                             buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.routed = Counter(PREFIX + "routed_requests", "Requests (and retries) sent to each instance.",
                              ["instance", "pool"], registry=r)
        self.inflight = Gauge(PREFIX + "instance_inflight", "This gateway's requests running on each instance.",
                              ["instance"], registry=r)
        self.state = Gauge(PREFIX + "instance_state", "1 for the instance's current state.", ["instance", "state"],
                           registry=r)
        self.transitions = Counter(PREFIX + "instance_transitions", "State changes (quarantine, failure, "
                                   "readmission, drain) per instance.", ["instance", "from_state", "to_state"],
                                   registry=r)
        self.pool_inflight = Gauge(PREFIX + "pool_inflight", "Requests running in each pool.", ["pool"], registry=r)
        self.pool_capacity = Gauge(PREFIX + "pool_capacity", "In-flight cap summed over each pool's routable "
                                   "instances.", ["pool"], registry=r)
        self.spillovers = Counter(PREFIX + "spillovers", "Requests sent to a tenant's later pool because the "
                                  "earlier ones were full.", ["pool"], registry=r)
        self.queue_depth = Gauge(PREFIX + "queue_depth", "Requests waiting for capacity, per class.", ["class"],
                                 registry=r)
        self.retries = Counter(PREFIX + "retries", "Requests retried on another instance before their first token.",
                               ["code"], registry=r)
        self.disaggregated = Counter(PREFIX + "disaggregated_requests", "Prefill/decode-split requests by outcome: "
                                     "prefill_decode, prefill_only (the first token ended it), decode_failed.",
                                     ["outcome"], registry=r)
        self.prefill_seconds = Histogram(PREFIX + "prefill_stage_seconds", "Disaggregated requests: the prefill "
                                         "stage's time in the gateway (routing to its last response).",
                                         registry=r)
        self.rate_limited = Counter(PREFIX + "rate_limited", "Requests refused by a tenant's rate limit.",
                                    ["tenant"], registry=r)
        self.config_reloads = Counter(PREFIX + "config_reloads", "Configuration file reloads.", ["result"],
                                      registry=r)
        self.jobs = Counter(PREFIX + "jobs", "Asynchronous jobs by state reached.", ["state"], registry=r)
        self.long_inflight = Gauge(PREFIX + "long_lane_inflight", "Long requests running.", registry=r)

    def set_state(self, instance: str, state: str) -> None:
        for s in STATES:
            self.state.labels(instance, s).set(1.0 if s == state else 0.0)

    def forget(self, instance: str) -> None:
        for s in STATES:
            try:
                self.state.remove(instance, s)
            except KeyError:
                pass
        try:
            self.inflight.remove(instance)
        except KeyError:
            pass

    def start_http_server(self, port: int, host: str = "0.0.0.0"):
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server, server.server_port
