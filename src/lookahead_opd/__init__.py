"""lookahead-opd: validation-gated weight extrapolation (EffOPD) for any torch optimizer.

The core (this package's top-level modules) depends on torch and numpy only and imports
nothing from the subpackages: ``lookahead_opd.integrations`` holds the Hugging Face, vLLM and
on-policy-distillation code (and the ``lookahead-opd`` command) and imports those lazily;
``lookahead_opd.diagnostic`` (the teacher-selection diagnostic) and ``lookahead_opd.demo`` (the
demo, its zoo and the torch-only toy) build on it.
"""

from .distributed import resharding
from .extrapolator import Extrapolator, JumpRecord, Summary
from .optimizer import ExtrapolatingOptimizer
from .options import PAPER_RULE, ExtrapolationOptions
from .schedule import Every, PowersOfTwo, Schedule, Steps
from .snapshot import FullSnapshot, LowRankSnapshot, SnapshotStore

__version__ = "0.1.0"

__all__ = [
    "ExtrapolatingOptimizer",
    "Extrapolator",
    "ExtrapolationOptions",
    "PAPER_RULE",
    "JumpRecord",
    "Summary",
    "Schedule",
    "PowersOfTwo",
    "Every",
    "Steps",
    "SnapshotStore",
    "FullSnapshot",
    "LowRankSnapshot",
    "resharding",
    "__version__",
]
