"""``benchmarks.common.QuickParser``: the --quick smoke-run convention of the engine benchmarks
(rollout, teacher_server) in one place: full or smoke defaults, the file-name suffix."""

from __future__ import annotations

from benchmarks.common import RESULTS_DIR, QuickParser


def parser() -> QuickParser:
    p = QuickParser("doc", "smoke run")
    p.quick_option("--rounds", 20, 2, "timed rounds")
    p.add_output_args()
    return p


def test_quick_sets_smoke_defaults_and_suffix_unless_given():
    full, quick = parser().parse_args([]), parser().parse_args(["--quick"])
    assert (full.rounds, full.suffix, full.output_dir, full.no_write) == (20, "", RESULTS_DIR, False)
    assert (quick.rounds, quick.suffix) == (2, "_quick")
    given = parser().parse_args(["--quick", "--rounds", "5", "--suffix", "_x"])
    assert (given.rounds, given.suffix) == (5, "_x")
    assert "timed rounds (20; 2 quick)" in parser().format_help()
