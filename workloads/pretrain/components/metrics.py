"""Rank-0 metric sink (batched MLflow), MFU's peak for this device (``hardware``) and peak memory.

Metric names are a contract with llmctl and its docs:
  train/loss  train/lr  train/grad_norm  val/loss
  perf/tokens_per_s (all devices)  perf/tokens_per_s_per_device  perf/tflops (per device)
  perf/mfu (only when the device's peak is known)  perf/peak_mem_gib (GiB, 2**30 bytes, as the
  memory plan counts)

One MLflow call per metric per step costs a store transaction each (a sqlite store writes one
file per call), so points are buffered and flushed with ``log_batch`` once per log interval.
"""

from __future__ import annotations

import os
import resource
import sys
import time

import torch

from workloads.planner.hardware import peak_for


def peak_tflops(device: torch.device, dtype: str) -> float | None:
    """Per-device dense peak for ``dtype`` ('bf16' or 'fp32'); None on CPU or an unknown GPU."""
    if device.type != "cuda":
        return None
    if dtype == "fp32" and torch.backends.cuda.matmul.allow_tf32:
        return None  # TF32 tensor cores: neither column of the table applies, so don't guess
    return peak_for(torch.cuda.get_device_name(device), dtype)


def peak_memory_gib(device: torch.device) -> float | None:
    """In GiB, the memory plan's unit (``llmctl plan``), so the two compare directly. CUDA: max
    allocated by the caching allocator. CPU: process peak RSS (``ru_maxrss``: KiB on Linux, bytes
    on macOS)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform.startswith("linux") else rss / 2**30


class MetricSink:
    """Buffers (key, value, step, timestamp) on rank 0 and ships them with ``log_batch``.

    Active only when ``MLFLOW_RUN_ID`` is set (the llmctl controller created the run and set
    ``MLFLOW_TRACKING_URI`` too); otherwise metrics only reach stdout. A tracking-server error
    is reported on stderr and does not stop training.
    """

    MAX_BATCH = 1000  # MLflow's per-request metric limit

    def __init__(self, enabled: bool = True):
        self.run_id = os.environ.get("MLFLOW_RUN_ID") if enabled else None
        self._buffer: list[tuple[str, float, int, int]] = []
        self.skip_upto: dict[str, int] = {}  # resumed run: {metric: last step already logged}
        self._client = None

    @property
    def active(self) -> bool:
        return self.run_id is not None

    def client(self):
        """The MLflow client of the run (None when inactive): artifacts such as lm-eval's samples."""
        if not self.active:
            return None
        if self._client is None:
            from mlflow.tracking import MlflowClient

            self._client = MlflowClient()
        return self._client

    def log(self, metrics: dict[str, float | None], step: int) -> None:
        if not self.active:
            return
        ts = int(time.time() * 1000)
        self._buffer += [
            (k, float(v), step, ts) for k, v in metrics.items() if v is not None and step > self.skip_upto.get(k, -1)
        ]

    def log_params(self, params: dict[str, str]) -> None:
        """What the trainer resolved at start (kernels, dtype) as run params, best-effort. MLflow
        params cannot change: a resume that resolves a key differently (another GPU, another torch)
        keeps the first value and says so on stderr."""
        if not self.active:
            return
        try:
            from mlflow.entities import Param

            if self._client is None:
                from mlflow.tracking import MlflowClient

                self._client = MlflowClient()
            logged = self._client.get_run(self.run_id).data.params
            new = {k: str(v) for k, v in params.items() if k not in logged}
            changed = [
                f"{k}={v} (first logged {logged[k]})" for k, v in params.items() if logged.get(k, str(v)) != str(v)
            ]
            if new:
                self._client.log_batch(self.run_id, params=[Param(k, v) for k, v in new.items()])
            if changed:
                print(f"warning: this start resolved {', '.join(changed)}", file=sys.stderr, flush=True)
        except Exception as e:
            print(f"warning: MLflow log_params failed ({type(e).__name__}: {e})", file=sys.stderr, flush=True)

    def flush(self) -> None:
        if not self.active or not self._buffer:
            return
        try:
            from mlflow.entities import Metric

            if self._client is None:
                from mlflow.tracking import MlflowClient

                self._client = MlflowClient()
            points = [Metric(key=k, value=v, timestamp=ts, step=s) for k, v, s, ts in self._buffer]
            for i in range(0, len(points), self.MAX_BATCH):
                self._log_batch(points[i : i + self.MAX_BATCH])
        except Exception as e:  # tracking is best-effort; the run's stdout still has everything
            print(
                f"warning: MLflow log_batch failed ({type(e).__name__}: {e}); dropped "
                f"{len(self._buffer)} metric points",
                file=sys.stderr,
                flush=True,
            )
        self._buffer.clear()

    LOCKED_RETRIES = 10  # ~1 min of backoff in all

    def _log_batch(self, points: list) -> None:
        """One ``log_batch`` (one transaction: a failed one wrote nothing), retried while sqlite is locked.

        Parallel trials (``llmctl launch -m``) write one sqlite file; a writer can get 'database is
        locked' past sqlite's busy timeout, and dropping the batch would lose metric points.
        """
        delay = 0.2
        for attempt in range(self.LOCKED_RETRIES + 1):
            try:
                self._client.log_batch(self.run_id, metrics=points)
                return
            except Exception as e:  # MlflowException or sqlalchemy OperationalError, same text
                if "database is locked" not in str(e) or attempt == self.LOCKED_RETRIES:
                    raise
                time.sleep(delay)
                delay = min(2 * delay, 10.0)


def format_train_line(step: int, steps: int, m: dict, no_mfu_reason: str = "cpu") -> str:
    """``step  10/100 | loss 6.1234 | lr 3.00e-03 | gnorm 0.91 | 12,345 tok/s | MFU 41.2%``."""
    width = len(str(steps))
    mfu = m.get("perf/mfu")
    mfu_s = f"MFU {100 * mfu:.1f}%" if mfu is not None else f"MFU n/a ({no_mfu_reason})"
    return (
        f"step {step:>{width}}/{steps} | loss {m['train/loss']:.4f} | lr {m['train/lr']:.2e} | "
        f"gnorm {m['train/grad_norm']:.2f} | {m['perf/tokens_per_s']:,.0f} tok/s | "
        f"{m['perf/tflops']:.2f} TFLOP/s | {mfu_s}"
    )
