"""Sweeps: one object (an id, a parent MLflow run) over many trials, run by a detached supervisor.

One job per module:
  expand      Hydra's sweep grammar → trials' overrides, composed fast (Hydra's own parser)
  planning    every trial planned and priced before anything exists; the budget split
  search      --search random|tpe: Hydra's Optuna sweeper grammar, Optuna's samplers, pruners, study
  state       the sweep's id, directory, spec and state files, and its status from MLflow
  control     launch -m / status / down / resume / --wait
  supervisor  the detached process: trial controllers with bounded parallelism
  table       the text tables both the plan and the status print
"""
