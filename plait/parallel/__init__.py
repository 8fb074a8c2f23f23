"""Parallelisms: each transforms a plain single-device model in place (one module each:
tensor_parallel.py, context_parallel.py, expert_parallel.py, pipeline/, the data-parallel
engines/), and `parallelize` (compose.py) composes them for a configuration."""

from plait.parallel.compose import Options, Parallelized, cross_entropy, parallelize, place

__all__ = ["Options", "Parallelized", "cross_entropy", "parallelize", "place"]
