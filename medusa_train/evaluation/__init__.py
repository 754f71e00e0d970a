"""Measuring heads: accepted length, per-head acceptance, speed against plain decoding, drift, reports."""
