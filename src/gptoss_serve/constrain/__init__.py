"""Constrained decoding: per-request grammars over the Harmony format, and their matchers."""
