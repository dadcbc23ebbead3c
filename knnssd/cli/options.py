"""What several commands take: shared options, their checks, and running a flow."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from knnssd.settings import DTYPE_HELP, DTYPES


def model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="smollm2 | gemma3-270m | local folder | .gguf | hub id")
    dtype_arg(p)
    device_arg(p)


def dtype_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="auto", choices=DTYPES, help=DTYPE_HELP)


def tracking_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tracking-uri", default=None,
                   help="MLflow tracking URI (default $MLFLOW_TRACKING_URI, else sqlite:///artifacts/mlflow.db)")


def bank_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bank", required=True, help="routed-drafters bank: models:/... URI or bank folder")


def sampling_args(p: argparse.ArgumentParser) -> None:
    """What one generation takes besides its length (``engine.spec.request_params.GenerateParams``)."""
    p.add_argument("--max-prompt-tokens", type=int, default=4096, help="longer prompts keep their last tokens (warned)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)


def device_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="auto (the GPU where CUDA has one, else the CPU) | cpu | cuda[:N]")


def counts(a, *names: str) -> None:
    """Options that count something: integers >= 1, one line otherwise (0 or a negative one once meant
    'all', or a slice from the end, and ran for minutes)."""
    for name in names:
        value = getattr(a, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value}")


def int_list(text: str, option: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x)
    except ValueError:
        raise ValueError(f"{option} takes integers separated by commas, got '{text}'") from None


def float_list(text: str, option: str) -> tuple[float, ...]:
    try:
        out = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        out = ()
    if not out:
        raise ValueError(f"{option} takes one or more numbers separated by commas, got '{text}'")
    return out


def url(host: str, port: int) -> str:
    """The address a server listens on, as a URL (an IPv6 host in brackets)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def json_option(text: str, option: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{option} is not JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{option} takes a JSON object, got {text!r:.60}")
    return value


def check_tracking(uri: str | None, registered: bool = False) -> None:
    """The tracking store answers and can be written (and, with ``registered``, may hold a registered
    version): checked in seconds, before any slow work."""
    from knnssd import tracking

    from knnssd.settings import tracking_uri

    tracking.check_reachable(tracking_uri(uri), registered)


def run_flow(fn, *args):
    """Run a flow (or a job that runs flows) against a Prefect API that answers, started here if none
    is set, so that it stops with this process however it ends."""
    from knnssd.flows.server import local_api

    with local_api():
        return fn(*args)


def read_file(path: str, option: str) -> str:
    """The text of a file an option names; a one-line error for a folder, a missing or unreadable file."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{option} {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None


def budget_args(p: argparse.ArgumentParser) -> None:
    """The search settings as options, made from ``search.budget.Budget`` (its one declaration): each
    option's dest is the field's name, so ``budget_values`` reads them back."""
    from knnssd.search.budget import settings

    for st in settings():
        metavar = st.flag.lstrip("-").replace("-", "_").upper()
        if isinstance(st.default, bool):  # a flag that turns a default-on setting off
            p.add_argument(st.flag, dest=st.name, action="store_false", help=st.help)
        elif isinstance(st.default, tuple):
            p.add_argument(st.flag, dest=st.name, default=list(st.default), type=lambda v: [x for x in v.split(",") if x],
                           metavar=metavar, help=f"{st.help} (comma-separated; default {','.join(st.default)})")
        else:
            p.add_argument(st.flag, dest=st.name, type=float if st.kind in (float, float | None) else int,
                           default=st.default, metavar=metavar,
                           help=f"{st.help} (default {'none' if st.default is None else st.default})")


def budget_values(a) -> dict:
    from knnssd.search.budget import settings

    return {st.name: getattr(a, st.name) for st in settings()}
