"""What the Hugging Face-based commands (``train``, ``demo``, ``diagnose``) share besides their
parser (``opd.config.parse_dataclass``): the checks of paths, devices and model ids that run
before any model loads, and the process-wide setting that a command makes, never a library
function (the model loading and writing bars).

Every check raises ``ValueError`` naming the bad value and what is accepted; the commands print
it on one line and exit with status 2.
"""

from __future__ import annotations

import importlib
from pathlib import Path

__all__ = ["check_output_dir", "check_device", "check_model_ref", "quiet_loading_bars"]


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
