"""Cost you can trust: an estimate before launch, a ledger after, a budget guard, reports.

- ``estimate``: FLOPs from the resolved config, throughput from the best evidence (earlier runs of
  the same shape on the same accelerator, else an MFU prior), priced per offer (SkyPilot catalog,
  spot and on-demand, or ``infra.price_per_gpu_hour``). Pure: the plan brings the hardware.
- ``history``: the MLflow side of calibration (find matching runs; record what a run measured).
- ``ledger``: billed attempts as tags on the run, summed into ``cost/actual_usd``; a managed
  job's recoveries reconciled into attempts.
- ``hooks``: the cost steps of the run lifecycle (budget refusal, estimate, close, status).
- ``report``: the ``llmctl runs`` and ``llmctl cost`` tables.

Stdlib only at module level, like the rest of ``llmctl``; mlflow and sky load inside functions.
"""
