"""Fault injection, small: the scenarios of `python -m serving.bench chaos` (serving/bench/chaos.py) against a real
gateway and two real instance processes under load from real gRPC clients. Each scenario must lose nothing (every
request ends with its whole answer or an explicit status), leak no KV page, and keep the books consistent. (A
multi-host follower killed mid-request: tests/sharding/test_multihost.py.)"""
from __future__ import annotations

import pytest

from models.synthetic import shared_small_llama
from serving.bench import chaos

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def _running(tmp_path_factory, name: str, **kw):
    """A started chaos.Cluster of the small Llama for a fixture to yield, stopped after."""
    c = chaos.Cluster(shared_small_llama(), str(tmp_path_factory.mktemp(name)), **kw)
    try:
        yield c.start()
    finally:
        c.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from _running(tmp_path_factory, "chaos", instances=2)


@pytest.fixture(scope="module")
def capacity(cluster):
    cap = chaos.capacity(cluster, 3.0)
    assert cap > 1, cap
    return cap


def _clean(row: chaos.Row) -> None:
    t = row.tally
    assert t.lost == 0, (row.scenario, t.lost_examples)
    assert row.pages_leaked == 0 and row.invariant_errors == 0, row


# Overload runs on its own cluster, one instance behind a gateway that holds 4 requests in flight and 4 queued, so a
# few arrivals past that bound must be refused. (On the shared cluster's bounds, 2 x 32 in flight and 64 queued, the
# load generator had to outrun the cluster by a wide margin on the same 2 shared cores; on a busy CI box its client,
# which reads every streamed token, sent 73 req/s against the cluster's 52 and nothing was refused.) Each request holds
# its place for OVERLOAD_TOKENS decode steps.
OVERLOAD_BOUNDS = {"admission": {"max_inflight_per_instance": 4, "queue_bounds": {"interactive": 4, "batch": 4}}}
OVERLOAD_TOKENS = 128
OVERLOAD_S = 2.0


@pytest.fixture(scope="module")
def small_cluster(tmp_path_factory):
    yield from _running(tmp_path_factory, "chaos-small", instances=1, gateway_config=OVERLOAD_BOUNDS)


@pytest.fixture(scope="module")
def full_capacity(small_cluster):
    """Requests/s of OVERLOAD_TOKENS tokens with as many in flight as the gateway admits at once (4): about what the
    small cluster can do at most."""
    cap = chaos.capacity(small_cluster, 4.0, concurrency=OVERLOAD_BOUNDS["admission"]["max_inflight_per_instance"],
                         max_tokens=OVERLOAD_TOKENS)
    assert cap > 1, cap
    return cap


def test_overload_is_refused_with_a_retry_hint_and_nothing_is_lost(small_cluster, full_capacity):
    # Arrivals at 10x capacity for 2 s: the load generator sends as fast as it can on 2 shared cores (it must reach
    # 2x), so the gateway's bounds fill however busy the machine is (capacity measured by a client on the same busy
    # cores is noisy; 2.5x of it sometimes left the bounds unfilled). The chaos benchmark runs 2x for 20 s.
    row = chaos.overload(small_cluster, 10 * full_capacity, OVERLOAD_S, max_tokens=OVERLOAD_TOKENS)
    assert row.tally.sent / OVERLOAD_S > 2 * full_capacity, (row.tally.sent, full_capacity)
    _clean(row)
    t = row.tally
    # Every request: its answer, or RESOURCE_EXHAUSTED with a retry hint, nothing else (no CANCELLED: gRPC core must
    # not drop calls the gateway's event loop has not taken yet, issue 22), and every one answered by the gateway's
    # own servicer.
    assert not t.failed and t.started_failed == 0, (dict(t.failed), t.failed_examples)
    assert t.ok > 0 and t.rejected > 0 and t.ok + t.rejected == t.sent, t
    assert row.gateway_counted == t.sent, row


def test_kill9_of_an_instance_under_load(cluster, capacity):
    row = chaos.kill_instance(cluster, 0.6 * capacity, 6.0)
    _clean(row)
    t = row.tally
    # Only requests already streaming from the victim fail (UNAVAILABLE, not retried: tokens were sent); the
    # rest complete, on the survivor when they had not started.
    assert set(t.failed) <= {"UNAVAILABLE"} and t.started_failed == t.num_failed, t.failed_examples
    assert t.ok + t.num_failed + t.rejected == t.sent and t.ok > t.sent // 2
    assert row.time_to_out_s is not None and row.time_to_out_s < 2.0, row
    assert row.time_to_readmit_s is not None


def test_hung_instance_deadlines_quarantine_and_readmission(cluster, capacity):
    row = chaos.hang_instance(cluster, 0.4 * capacity, 8.0, hang_s=4.0, deadline_s=2.0)
    _clean(row)  # no request outlived its deadline by more than chaos.GRACE_S
    t = row.tally
    assert set(t.failed) <= {"DEADLINE_EXCEEDED", "UNAVAILABLE"}, t.failed_examples
    assert t.ok > t.sent // 2
    # Silent for silent_after_s (2 s in the cluster's configuration) plus a health window: out of the rotation.
    assert row.time_to_out_s is not None and row.time_to_out_s < 4.0, row
    assert row.time_to_readmit_s is not None


def test_cancel_storm_frees_every_page_and_later_answers_are_unchanged(cluster):
    row = chaos.cancel_storm(cluster, 200)
    _clean(row)
    t = row.tally
    assert t.cancelled + t.num_failed + t.rejected + t.ok == t.sent and t.num_failed == 0, t
    assert t.ok == 8 and t.cancelled == 200  # after the storm, the same 8 greedy answers as before it


def test_gateway_killed_with_jobs_in_flight(cluster):
    row = chaos.restart_gateway_with_jobs(cluster, 20)
    _clean(row)
    assert row.tally.ok == 20 and row.tally.num_failed == 0, row.tally
