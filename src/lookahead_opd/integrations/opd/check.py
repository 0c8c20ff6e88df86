"""``lookahead-opd check``: the preflight of a ``lookahead-opd train`` run, with the same
options. It builds the run as ``train`` would and runs the checks ``train`` runs before step 0
(``preflight.py``; ``--preflight_rollouts`` adds the ones that sample a few rollouts), prints
what it checked, one line each, and exits 0 when clean, 2 on a fault (each fault one line on
stderr naming the fix).

    lookahead-opd check --student S --teacher T --loss topk_reverse_kl --preflight_rollouts
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["main", "EPILOG"]

EPILOG = """\
the checks `lookahead-opd train` runs before step 0, with train's options: template and
tokenizer (student and teacher), the teacher's temperature; with --preflight_rollouts, on a
few rollouts, student = teacher gives a zero loss and gate, and a top-k loss's mass.
exit status: 0 clean (warnings allowed), 2 a fault (one line naming the fix)"""


def _no_writers(config) -> None:
    """A check writes nothing: no TensorBoard folder, no W&B run."""
    config.report_to = "none"


def main(argv: Sequence[str] | None = None) -> int:
    from .preflight import report
    from .served import TeacherServerError
    from .train import setup_run

    prog = "lookahead-opd check"
    try:
        config, trainer, findings = setup_run(argv, prog, epilog=EPILOG, adjust=_no_writers)
    except (ValueError, TeacherServerError) as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return 2
    status = report(findings, prog, enabled=trainer.rank == 0)
    if trainer.rank == 0:
        faults = sum(f.fault for f in findings)
        more = "" if config.preflight_rollouts else "; --preflight_rollouts adds the rollout checks"
        print(f"{len(findings)} checks, {faults or 'no'} fault{'s' if faults != 1 else ''}{more}")
    return status
