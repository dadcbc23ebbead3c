"""Benchmarks that print ratios measured side by side in one process: a bank against baselines
(bank) and the engine's drafters on fixed configurations (engine)."""
