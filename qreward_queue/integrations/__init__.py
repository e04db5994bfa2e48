"""Adapters between RL trainers and qrq: one module per trainer, each importable without it.

The shared parts: `batcher` (per-process micro-batcher for per-sample callers), `coerce`
(trainer values -> valid samples), `guard` (no embedded mode under multi-process trainers).
"""
