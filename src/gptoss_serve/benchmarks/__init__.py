"""Benchmarks that run as clients: a load generator for the HTTP server (no torch, no engine)."""
