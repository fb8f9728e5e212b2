"""CPU, memory, disk, network (and GPU, with ``nvidia-ml-py``) of each node into the run, from one
process per node (local rank 0), through MLflow's own system metrics monitor. Each node's metrics
carry its node rank: ``system/node-<N>/cpu_utilization_percentage`` (MLflow's System metrics tab).

Needs ``psutil`` (``pip install 'llmctl-train[system]'``); without it the run says so once and goes on.
The sampling interval is MLflow's (10 s; ``MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL``).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional


def node_id() -> str:
    """``node-<N>``: torchrun's node rank (``GROUP_RANK``), or SkyPilot's (``SKYPILOT_NODE_RANK``)."""
    return f"node-{os.environ.get('GROUP_RANK') or os.environ.get('SKYPILOT_NODE_RANK') or 0}"


def start() -> Optional[Any]:
    """Start the monitor in this node's local rank 0 of an llmctl run; None elsewhere."""
    run_id = os.environ.get("MLFLOW_RUN_ID")
    if not run_id or os.environ.get("LOCAL_RANK", "0") != "0":
        return None
    try:
        import psutil  # noqa: F401 - MLflow's CPU monitor needs it
    except ImportError:
        if os.environ.get("RANK", "0") == "0":
            print("pretrain: no system metrics (psutil not installed: pip install 'llmctl-train[system]')", flush=True)
        return None
    try:
        import logging

        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)  # no start/stop lines in the run's log

        monitor = SystemMetricsMonitor(run_id, node_id=node_id(), resume_logging=True)
        monitor.start()
        return monitor
    except Exception as e:
        print(f"warning: system metrics not started ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
        return None


def stop(monitor: Optional[Any]) -> None:
    """Stop the monitor and log one closing sample.

    MLflow's loop publishes only after a full sampling interval and drops the sample it holds when
    it is told to stop, so a run shorter than one interval (or a slow first interval on a loaded
    machine) would otherwise end with no system metrics at all; the closing sample also covers the
    run's last partial interval.
    """
    if monitor is None:
        return
    monitor.finish()  # joins the sampling thread: the monitor is ours alone from here
    try:
        monitor.collect_metrics()
        monitor.publish_metrics(monitor.aggregate_metrics())
        monitor.mlflow_logger.flush()
    except Exception as e:
        print(f"warning: last system metrics sample not logged ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
