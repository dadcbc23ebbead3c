"""The options the scripts in ``benchmarks/`` share, each added to a parser here: what ``--dtype`` takes (the
CLI's rule, ``settings.DTYPES``), the prompts, new tokens and threads, and the model or the bank measured. Where
the scripts' defaults differ, the default is the caller's argument."""
from __future__ import annotations

import argparse

from knnssd.settings import DTYPE_HELP, DTYPES

CHAMPION = "models:/knnssd-smollm2@champion"  # the registered bank the scripts measure by default


def dtype(p: argparse.ArgumentParser, default: str = "auto", choices: tuple[str, ...] = DTYPES) -> None:
    """``--dtype``: one precision, as the CLI's commands take it (``choices``: the subset a script measures)."""
    p.add_argument("--dtype", default=default, choices=choices, help=DTYPE_HELP if choices == DTYPES else None)


def dtypes(p: argparse.ArgumentParser, default: tuple[str, ...], choices: tuple[str, ...] = DTYPES,
           help: str | None = None) -> None:
    """``--dtype`` for a script that measures several precisions in turn: each given, the option repeated or its
    values comma-separated, else ``default``; a name not in ``choices`` is the parser's one-line error."""

    def names(text: str) -> list[str]:
        out = [v for v in text.split(",") if v]
        if not out or any(v not in choices for v in out):
            raise argparse.ArgumentTypeError(f"{text!r}: each must be one of {', '.join(choices)}")
        return out

    p.add_argument("--dtype", type=names, action=_Given, default=list(default), metavar="DTYPE[,DTYPE]",
                   help=help or f"precisions, each of {' | '.join(choices)} (default: {','.join(default)})")


class _Given(argparse.Action):
    """The values of every use of the option, in order; the default only where it is not used."""

    def __call__(self, parser, namespace, values, option_string=None):
        got = getattr(namespace, self.dest)
        setattr(namespace, self.dest, [*(() if got is self.default else got), *values])


def model(p: argparse.ArgumentParser, default: str = "smollm2", choices: list[str] | None = None) -> None:
    """``--model``: what ``models.load`` takes (an embedded model's name, a folder, a .gguf, a hub id)."""
    p.add_argument("--model", default=default, choices=choices)


def bank(p: argparse.ArgumentParser, default: str | None = CHAMPION, required: bool = False,
         help: str | None = None) -> None:
    """``--model-uri`` (a registered bank version) and the ``--tracking-uri`` of its registry."""
    p.add_argument("--model-uri", default=None if required else default, required=required, help=help)
    p.add_argument("--tracking-uri", default=None, required=required)


def prompts(p: argparse.ArgumentParser, default: int, help: str | None = None) -> None:
    """``--prompts``: how many eval prompts (``help`` says how the script picks them)."""
    p.add_argument("--prompts", type=int, default=default, help=help)


def max_new_tokens(p: argparse.ArgumentParser, default: int = 128) -> None:
    p.add_argument("--max-new-tokens", type=int, default=default)


def threads(p: argparse.ArgumentParser, default: int = 2) -> None:
    """``--threads``: torch's threads, which the script sets before it loads a model."""
    p.add_argument("--threads", type=int, default=default)
