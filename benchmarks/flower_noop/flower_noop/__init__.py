"""Flower's own messaging time: a ClientApp that answers at once (benchmarks/deploy.py)."""
