"""`knnssd demo`: the main job."""
from __future__ import annotations

import argparse

from knnssd.cli.command import command
from knnssd.cli.options import model_args, run_flow


def _demo_options(p: argparse.ArgumentParser) -> None:
    model_args(p)
    p.add_argument("--trials", type=int, default=6)
    p.add_argument("--candidates", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=64)


@command("demo", "the main job: calibrate a small bank, register it, generate a mixed stream", _demo_options)
def cmd_demo(a) -> int:
    from knnssd.demo import DemoConfig, calibrate_params, run

    cfg = DemoConfig(model=a.model, dtype=a.dtype, device=a.device, trials=a.trials, candidates=a.candidates,
                     max_new_tokens=a.max_new_tokens)
    calibrate_params(cfg).budget()  # bad counts fail here, before the Prefect server starts
    run_flow(run, cfg)
    return 0


# in the order `knnssd --help` lists them
COMMANDS = (cmd_demo,)
