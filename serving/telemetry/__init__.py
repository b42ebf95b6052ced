"""Prometheus metrics and OpenTelemetry traces of the serving processes."""
