"""Metrics, benchmarks and plots."""
