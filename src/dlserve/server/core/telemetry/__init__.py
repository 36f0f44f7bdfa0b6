"""Metrics, statistics, log settings and request tracing."""
