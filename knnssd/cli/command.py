"""One ``knnssd`` command: its name, its one-line help, the options it declares and the handler that runs it,
written together where the handler is (``@command`` over the handler, its options function just above)."""
from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    options: Callable[[argparse.ArgumentParser], None]  # adds the command's arguments to its parser
    run: Callable[[argparse.Namespace], int]  # the handler: the exit status
    mlflow: bool = True  # whether the command uses MLflow (set up before it runs)
    description: str | None = None  # its --help's text, where longer than ``help``

    def add(self, sub) -> argparse.ArgumentParser:
        """The command's parser in ``sub`` (an ``add_subparsers`` action)."""
        p = sub.add_parser(self.name, help=self.help, description=self.description)
        self.options(p)
        p.set_defaults(fn=self.run, mlflow=self.mlflow)
        return p


def command(name: str, help: str, options: Callable[[argparse.ArgumentParser], None], mlflow: bool = True,
            description: str | None = None) -> Callable[[Callable[[argparse.Namespace], int]], Command]:
    """The handler below as a ``Command`` named ``name``, whose parser ``options`` fills."""
    return lambda run: Command(name, help, options, run, mlflow, description)
