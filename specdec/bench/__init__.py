"""Benchmark runners, peers and reports."""
