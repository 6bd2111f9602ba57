"""Calibration: benchmark results -> EngineProfile -> TP2 fit -> the planner's predictions against them.

The layers, each importing only the ones above it (and the planner, catalogue and documents),
never the CLI in v100plan/commands/:

  fit.py          least-squares line and the BenchProblem error shared by every builder
  views.py        which catalogue model and card a bench ran (shape, identified card) and the
                  planner's Hardware for that card (from a probe report, else the catalogue)
  single.py       `python -m engine bench` (one GPU) -> EngineProfile
  tp2_fit.py      the TP2 bandwidth fractions fitted on a two-GPU bench's short contexts
  tp2_profile.py  `python -m engine bench-tp2` -> EngineProfile (single.py's builder + tp2_fit)
  tp2_compare.py  the planner's TP1/TP2 round against what the two-GPU bench measured

How each number is measured and fitted: docs/engine.md and docs/multigpu.md.
"""
