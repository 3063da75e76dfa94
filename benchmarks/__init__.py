"""Benchmarks of hf-ext against stock transformers; results and the commands that produced them: docs/benchmarks.md.

``harness`` holds what every bench shares (2-rank launches, environment, host facts, statistics, tables, JSON,
docs sections, the synthetic dataset); ``worker`` is the one training worker the launches run. Each
``bench_*`` module is an entry point: ``python -m benchmarks.bench_train --help``.
"""
