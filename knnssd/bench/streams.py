"""The eval streams the drafting scripts decode (``benchmarks/suffix_stream.py``, ``tree_replay.py``), and
their Markdown tables: a mixed stream, round robin over the five domains, and a repetitive one, the eval
prompts of one domain (the same task again and again, as a batch flow runs it)."""
from __future__ import annotations

import argparse
from pathlib import Path

from knnssd import prompts
from knnssd.bench import markdown, options
from knnssd.bench.throughput import mixed_prompts


def repetitive(spec: str) -> tuple[str, int]:
    """``DOMAIN:N`` -> (domain, N), or a one-line ValueError."""
    domain, _, n = spec.partition(":")
    if domain not in prompts.DOMAINS or not n.isdigit() or int(n) < 1:
        raise ValueError(f"--repetitive must be DOMAIN:N with DOMAIN one of {', '.join(prompts.DOMAINS)} and N >= 1")
    return domain, int(n)


def load(data: Path, mixed: int, domain: str, n: int) -> dict[str, list[str]]:
    """{"mixed": ``mixed`` prompts, "repetitive (<domain>)": ``n`` of ``domain``'s}, eval rows only."""
    return {"mixed": [p.prompt for p in mixed_prompts(data, mixed)],
            f"repetitive ({domain})": [p.prompt for p in prompts.load_domains(data, (domain,), "eval", n)]}


def add_arguments(ap: argparse.ArgumentParser, mixed: int) -> None:
    """The scripts' stream options: the prompt folder, the two streams, new tokens and dtype."""
    ap.add_argument("--data", default=None, help="the prompt folder (default: ../shared/data)")
    ap.add_argument("--mixed", type=int, default=mixed, help="eval prompts, round robin over the domains")
    ap.add_argument("--repetitive", default="text_to_sql:20", help="DOMAIN:N eval prompts of one domain")
    options.max_new_tokens(ap)
    options.dtype(ap)


def from_arguments(ap: argparse.ArgumentParser, a: argparse.Namespace) -> tuple[dict[str, list[str]], str]:
    """The streams ``add_arguments``' options name, and the repetitive stream's key; a bad value is
    ``ap.error``'s one line, before any model loads."""
    if a.mixed < 1 or a.max_new_tokens < 1:
        ap.error("--mixed and --max-new-tokens must be at least 1")
    data = prompts.default_data_dir() if a.data is None else Path(a.data)
    try:
        domain, n = repetitive(a.repetitive)
        return load(data, a.mixed, domain, n), f"repetitive ({domain})"
    except (ValueError, OSError) as e:  # a malformed spec, more prompts than the folder holds, no folder
        ap.error(str(e))


def table(title: str, first: str, rows: dict[str, dict], columns: list[tuple[str, str, str]]) -> str:
    """A Markdown table under ``title``: a row per key of ``rows`` (its column headed ``first``), then
    ``columns``, each (header, field, format spec)."""
    lines = markdown.table([first, *(h for h, _, _ in columns)],
                           ([name, *(format(r[f], spec) for _, f, spec in columns)] for name, r in rows.items()),
                           "l" + "r" * len(columns))
    return "\n".join([f"\n{title}\n", *lines])
