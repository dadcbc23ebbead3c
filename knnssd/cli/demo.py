"""`knnssd demo`: the main job."""
from __future__ import annotations

from knnssd.cli.options import model_args, run_flow


def cmd_demo(a) -> int:
    from knnssd.demo import DemoConfig, calibrate_params, run

    cfg = DemoConfig(model=a.model, dtype=a.dtype, device=a.device, trials=a.trials, candidates=a.candidates,
                     max_new_tokens=a.max_new_tokens)
    calibrate_params(cfg).budget()  # bad counts fail here, before the Prefect server starts
    run_flow(run, cfg)
    return 0


def add(sub) -> None:
    d = sub.add_parser("demo", help="the main job: calibrate a small bank, register it, generate a mixed stream")
    model_args(d)
    d.add_argument("--trials", type=int, default=6)
    d.add_argument("--candidates", type=int, default=2)
    d.add_argument("--max-new-tokens", type=int, default=64)
    d.set_defaults(fn=cmd_demo)
