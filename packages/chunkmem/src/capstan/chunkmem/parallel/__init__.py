"""Chunks over a data-parallel group: sharded, each rank owning 1/dp of them (sharding.py, ZeRO-3), or
replicated on every rank for 1-bit Adam (replicated.py)."""
