"""What the Hugging Face-based commands (``train``, ``check``, ``demo``, ``diagnose``) share: the
parser generated from a config dataclass (``parse_dataclass``), the checks of paths, devices and
model ids that run before any model loads, and the process-wide setting that a command makes,
never a library function (the model loading and writing bars).

Every check raises ``ValueError`` naming the bad value and what is accepted; the commands print
it on one line and exit with status 2.
"""

from __future__ import annotations

import dataclasses
import importlib
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["parse_dataclass", "check_output_dir", "check_device", "check_model_ref",
           "quiet_loading_bars"]


def check_output_dir(path: str, option: str = "output_dir") -> None:
    """``path`` must be a directory or creatable as one: not a file, not under a file."""
    p = Path(path).expanduser()
    for parent in (p, *p.parents):
        if parent.exists():
            if not parent.is_dir():
                where = "is a file" if parent == p else f"is under {parent}, which is a file"
                raise ValueError(f"{option} {path} {where}; give a directory")
            return


def check_device(device: str) -> None:
    """``device`` must name a torch device this torch can use."""
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device must be a torch device such as cpu, cuda or cuda:1; "
                         f"got {device!r}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = (f"CUDA {torch.version.cuda}, but no GPU is visible" if torch.version.cuda
                     else "a CPU-only build")
            raise ValueError(f"device {device!r}: this torch ({torch.__version__}) is {build}; "
                             f"use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: only {torch.cuda.device_count()} GPU(s) visible")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {device!r}: MPS is not available here; use --device cpu")


def check_model_ref(role: str, ref: str) -> None:
    """``ref`` must be a saved model directory, a named model source (``model_sources``: no
    network; only its extra is checked here, the conversion runs when the model loads), or a
    Hub id that is in the local Hugging Face cache or that the Hub has. Asked once, without
    retries: an unreachable Hub fails here in seconds instead of after the download's minute
    of retries."""
    from .model_sources import SOURCES, check_source, is_named_source

    if not ref:
        raise ValueError(f"--{role} is required (a Hugging Face model id, a local directory, or "
                         f"one of the named sources {', '.join(SOURCES)})")
    if is_named_source(ref):
        check_source(ref)
        return
    path = Path(ref).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ValueError(f"{role} directory {ref} has no config.json (not a saved HF model)")
        return
    if ref.startswith((".", "/", "~")) or ref.count("/") > 1:
        raise ValueError(f"{role} path {ref} does not exist")
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, RepositoryNotFoundError

    missing = (f"{role} {ref!r} was not found: it is not a local directory (local directories "
               f"need no network)")
    try:
        if isinstance(huggingface_hub.try_to_load_from_cache(ref, "config.json"), str):
            return
    except HFValidationError:
        raise ValueError(f"{missing}, nor a valid Hugging Face model id") from None
    if constants.HF_HUB_OFFLINE:
        raise ValueError(f"{missing}, and not in the Hugging Face cache (HF_HUB_OFFLINE is set)")
    try:
        huggingface_hub.HfApi().model_info(ref, timeout=10)
    except RepositoryNotFoundError:
        raise ValueError(f"{missing}, nor on the Hugging Face Hub") from None
    except (HfHubHTTPError, *_network_errors()) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(f"{missing}, not in the Hugging Face cache, and the Hub could not be "
                         f"reached ({reason})") from None


def _network_errors() -> tuple[type[BaseException], ...]:
    """What a failed connection raises in the HTTP client ``huggingface_hub`` uses: requests'
    errors are ``OSError``; httpx's (huggingface_hub >= 1) are not."""
    errors: list[type[BaseException]] = [OSError]
    for name in ("httpx", "httpx2"):
        try:
            errors.append(importlib.import_module(name).TransportError)
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


def quiet_loading_bars() -> None:
    """Turn off the progress bars of model loading, saving and downloads (transformers and
    huggingface_hub), as ``--no_progress`` turns off the command's own."""
    import huggingface_hub
    import transformers

    transformers.utils.logging.disable_progress_bar()
    huggingface_hub.utils.disable_progress_bars()


def _or_none(convert: Any) -> Any:
    """``convert``, except that ``none`` (any case) is ``None``: the value that turns off an
    option whose default is on."""
    def parse(text: str) -> Any:
        return None if text.lower() == "none" else convert(text)

    parse.__name__ = getattr(convert, "__name__", "value")  # argparse's "invalid int value"
    return parse


def parse_dataclass(cls: type, args: Sequence[str], *, prog: str,
                    defaults: dict[str, Any] | None = None, epilog: str | None = None) -> Any:
    """An instance of the config dataclass ``cls`` from command-line ``args``, one flag per
    field (``transformers.HfArgumentParser``, TRL's convention), ``defaults`` replacing the
    fields' own. Only each field's ``help`` reaches argparse: ``choices`` and ``minimum`` are
    checked by the config itself, with its own messages. A parse error is one line (a
    ``UsageError``), ``--flag -1e-3`` is a negative number, an optional field takes ``none``
    (``--patience none``), and ``--no_x`` says what it does (the field's ``negated_help``).
    ``epilog`` ends ``--help``, its lines kept as written. Fields named in ``cls.CLI_HIDDEN``
    (ones the command sets itself) get no flag and keep their defaults."""
    import argparse

    from transformers import HfArgumentParser

    from .cli import ArgumentParser

    class Parser(ArgumentParser, HfArgumentParser):
        pass

    class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
        pass

    hints = typing.get_type_hints(cls)
    hidden = set(getattr(cls, "CLI_HIDDEN", ()))
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name not in hidden}
    plain = dataclasses.make_dataclass(cls.__name__, [
        (f.name, hints[f.name], dataclasses.field(
            default=f.default, default_factory=f.default_factory,
            metadata={"help": f.metadata.get("help", "")}))
        for f in fields.values()])
    parser = Parser(plain, prog=prog, epilog=epilog, formatter_class=Formatter)
    if defaults:
        parser.set_defaults(**defaults)
    for action in parser._actions:
        optional = action.dest in fields and type(None) in typing.get_args(hints[action.dest])
        if optional and callable(action.type):  # --patience none: a default turned off
            action.type = _or_none(action.type)
        # HfArgumentParser gives --no_x the help of --x
        if isinstance(action, argparse._StoreFalseAction) and action.dest in fields:
            meta = fields[action.dest].metadata
            action.help = meta.get("negated_help") or f"turn off: {meta.get('help', '')}"
            action.default = argparse.SUPPRESS  # --x holds the default; no "(default: ...)"
    parsed, rest = parser.parse_args_into_dataclasses(args=list(args),
                                                      return_remaining_strings=True)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return cls(**{name: getattr(parsed, name) for name in fields})
