"""Benchmarks that print ratios measured side by side in one process: a bank against baselines
(bank; what its measurements add up to, bank_summary) and the engine's drafters on fixed
configurations (engine). And what the scripts in ``benchmarks/`` share: their options (options),
the one Markdown table writer (markdown), the eval streams (streams), and the GPU check's models and
report (packed_blocks, shapes, gpu_report)."""
