"""The gRPC server options the instance server and the gateway both take (`server_options`): messages over the size
limit refused by gRPC core before anything decodes them, a cap on concurrent streams per connection, keepalive
enforcement (a ping flood is answered with GOAWAY), idle connections closed, and the pending-calls limit."""
from __future__ import annotations

# The transport limit sits this far above --max_request_bytes: a request a little over the limit still gets the
# servers' own INVALID_ARGUMENT naming the prompt field; anything larger is refused by gRPC core (RESOURCE_EXHAUSTED,
# "Received message larger than max") before a byte of it is decoded.
TRANSPORT_SLACK_BYTES = 64 << 10
MAX_CONCURRENT_STREAMS = 1024  # per connection; the gateway's channel to an instance carries all its requests
MIN_PING_INTERVAL_MS = 300_000  # pings without data more often than this are strikes (gRPC's own default)
MAX_PING_STRIKES = 2  # then GOAWAY (ENHANCE_YOUR_CALM, "too_many_pings")
MAX_CONNECTION_IDLE_MS = 300_000  # a connection with no call for 5 minutes is closed (clients reconnect)
MAX_CONNECTION_AGE_MS = 3_600_000  # then GOAWAY: new calls open a new connection; running streams finish
# gRPC core keeps the calls its transport has accepted but the application has not taken yet (grpc.aio takes them one
# at a time, from the event loop, so a busy loop falls behind). Past `grpc.server.max_pending_requests` of them (default
# 1,000) core drops new calls at random, and every one past the hard limit (default 3,000): each ends CANCELLED with no
# retry hint, before any handler runs (issue 22). Overload is for admission control to answer (RESOURCE_EXHAUSTED with
# grpc-retry-pushback-ms), so core's limit sits far above any backlog a deadline leaves alive (65,536 calls: over 30 s
# of arrivals at 2,000/s); it only bounds memory.
PENDING_CALLS_LIMIT = 1 << 16


def transport_limit(max_request_bytes: int) -> int:
    return max_request_bytes + TRANSPORT_SLACK_BYTES


def server_options(max_request_bytes: int, max_concurrent_streams: int = MAX_CONCURRENT_STREAMS,
                   max_send_bytes: int = 64 << 20) -> list[tuple[str, int]]:
    if max_concurrent_streams < 1:
        raise ValueError(f"max_concurrent_streams must be >= 1, got {max_concurrent_streams}")
    return [("grpc.max_receive_message_length", transport_limit(max_request_bytes)),
            ("grpc.max_send_message_length", max_send_bytes),
            ("grpc.max_concurrent_streams", max_concurrent_streams),
            ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
            ("grpc.http2.max_ping_strikes", MAX_PING_STRIKES),
            ("grpc.keepalive_permit_without_calls", 0),
            ("grpc.max_connection_idle_ms", MAX_CONNECTION_IDLE_MS),
            ("grpc.max_connection_age_ms", MAX_CONNECTION_AGE_MS),
            ("grpc.so_reuseport", 0),
            ("grpc.server.max_pending_requests", PENDING_CALLS_LIMIT),
            ("grpc.server.max_pending_requests_hard_limit", PENDING_CALLS_LIMIT)]
