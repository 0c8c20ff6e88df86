"""The demo and its fixtures: ``lookahead-opd demo`` (``run``: plain OPD vs EffOPD on a tiny
model, measured), the zoo that builds its student/teacher pairs (``zoo``), the shipped pair
(``pairs/``, package data), the comparison of runs (``compare``) and the torch-only
``lookahead-opd toy`` (``toy``).

The demo imports the OPD loop (``lookahead_opd.integrations.opd``); the loop never imports the
demo. Each submodule imports its heavy dependencies itself, so ``toy`` needs torch only.
"""
