"""The ``lookahead-opd`` command. Each subcommand imports its module only when it runs, so
``lookahead-opd toy`` works with the torch-only core and the others fail with one clear line
when the ``hf`` extra is missing."""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from collections.abc import Sequence

# name -> (module with a ``main(argv) -> int``, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "diagnose": ("lookahead_opd.diagnostic.cli", "rank OPD teachers without training: the per-token gradient diagnostic"),
    "demo": ("lookahead_opd.demo.run", "the main job: plain OPD vs EffOPD on a tiny model, measured"),
    "train": ("lookahead_opd.integrations.opd.train", "OPD / EffOPD on any Hugging Face causal LMs"),
    "check": ("lookahead_opd.integrations.opd.check", "the preflight of a train run (same options): "
              "tokenizers, template, teacher temperature, identity"),
    "toy": ("lookahead_opd.demo.toy", "torch-only example: a small MLP trained plain and wrapped"),
}

_USAGE = "usage: lookahead-opd {" + ",".join(COMMANDS) + "} [options]   (-h after a command for its options)"


class UsageError(ValueError):
    """Bad command-line input: the command prints it on one line and exits with status 2."""


class ArgumentParser(argparse.ArgumentParser):
    """``argparse`` with the commands' two conventions: a parse error is one line (raised as a
    ``UsageError``, not argparse's usage block and ``SystemExit``), and ``--flag -1e-3`` reads
    as a negative number (argparse's own matcher takes ``-1e-3`` for an option)."""

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(f"{message} (see {self.prog} -h)")

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        args = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(_attach_negative_numbers(args), namespace)


def _attach_negative_numbers(args: list[str]) -> list[str]:
    """``["--lr", "-1e-3"]`` -> ``["--lr=-1e-3"]``: no option starts with a minus and a digit, so
    such a word is the previous flag's value (``-1e-3``, ``-1,2``), whatever argparse's
    negative-number pattern says (Python 3.13 widened it the same way)."""
    out: list[str] = []
    for arg in args:
        if out and out[-1].startswith("--") and "=" not in out[-1] and _NEGATIVE.match(arg):
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


_NEGATIVE = re.compile(r"-\.?\d")


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch ``lookahead-opd <command> [options]`` to the command's module."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_USAGE)
        for name, (_, help_) in COMMANDS.items():
            print(f"  {name:<10} {help_}")
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"lookahead-opd: unknown command {name!r}; expected one of {', '.join(COMMANDS)}",
              file=sys.stderr)
        return 2
    module_name, _ = COMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:  # an optional extra is missing
        print(f"lookahead-opd {name}: {err}. Install the extra: pip install 'lookahead-opd[hf]'",
              file=sys.stderr)
        return 1
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
