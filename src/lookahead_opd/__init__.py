"""lookahead-opd: validation-gated weight extrapolation (EffOPD) for any torch optimizer.

The core (this package) depends on torch and numpy only; ``lookahead_opd.integrations``
holds the Hugging Face, vLLM and on-policy-distillation code and imports those lazily.
"""

from .distributed import resharding
from .extrapolator import Extrapolator, JumpRecord, Summary
from .optimizer import ExtrapolatingOptimizer
from .options import ExtrapolationOptions
from .schedule import Every, PowersOfTwo, Schedule, Steps
from .snapshot import FullSnapshot, LowRankSnapshot, SnapshotStore

__version__ = "0.1.0"

__all__ = [
    "ExtrapolatingOptimizer",
    "Extrapolator",
    "ExtrapolationOptions",
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
