"""Benchmarks: host-side overhead of the serving core (host_overhead); more to come."""
