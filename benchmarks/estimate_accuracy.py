"""How close is llmctl's wall-time estimate? Calibrate on one run here, predict another, run it.

    python benchmarks/estimate_accuracy.py

1. prime the tokenizer/corpus cache (so neither run pays for building it);
2. calibration run: ``llmctl launch`` of the smoke model for CALIB_STEPS steps (local, CPU);
3. ``llmctl plan`` of a run of a different length (PREDICT_STEPS): the estimate now cites run 1;
4. launch it; compare the estimate it logged (``time/estimate_h``) with its billed wall time
   (``time/wall_s``, the ledger's attempt).
Last line: ``estimate_accuracy: <predicted / actual>`` (1.0 is perfect; goal within 0.85-1.15).
Everything lives in a temp dir; takes a few minutes on a 2-core machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CALIB_STEPS, PREDICT_STEPS = 30, 75
COMMON = ["model=smoke", "train.batch_size=16", "train.seq_len=128", "train.log_every=5", "train.val_every=25",
          "checkpoint.every=0", "infra.price_per_gpu_hour=1.0"]


def llmctl(args: list[str], cwd: Path, env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, "-m", "llmctl", *args], cwd=cwd, env=env, text=True, capture_output=True)
    if out.returncode != 0:
        sys.exit(f"llmctl {' '.join(args)} failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return out.stdout


def prime_cache(cwd: Path, env: dict[str, str]) -> None:
    code = ("from omegaconf import OmegaConf; from llmctl.config import compose;"
            "from workloads.pretrain.data import prepare_corpus;"
            f"prepare_corpus(OmegaConf.create(compose({COMMON!r}).cfg['data']))")
    subprocess.run([sys.executable, "-c", code], cwd=cwd, env={**env, "PYTHONPATH": str(ROOT)}, check=True)


def main() -> None:
    from mlflow.tracking import MlflowClient

    with tempfile.TemporaryDirectory(prefix="llmctl-estimate-") as tmp:
        work = Path(tmp)
        uri = f"sqlite:///{work / 'mlflow.db'}"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "LLMCTL_"))}
        env.update({"MLFLOW_TRACKING_URI": uri, "LLMCTL_CACHE_DIR": str(work / "cache"), "PYTHONUNBUFFERED": "1"})
        prime_cache(work, env)

        llmctl(["launch", *COMMON, f"train.steps={CALIB_STEPS}", "tracking.run_name=calibration"], work, env)
        plan = llmctl(["plan", *COMMON, f"train.steps={PREDICT_STEPS}"], work, env)
        print(plan[plan.index("# cost estimate"):].rstrip())
        llmctl(["launch", *COMMON, f"train.steps={PREDICT_STEPS}", "tracking.run_name=predicted"], work, env)

        mc = MlflowClient(uri)
        runs = {r.info.run_name: r for r in mc.search_runs([e.experiment_id for e in mc.search_experiments()])}
        calib, run = runs["calibration"].data.metrics, runs["predicted"].data.metrics
        predicted, actual = run["time/estimate_h"] * 3600, run["time/wall_s"]
        print(f"calibration run: {CALIB_STEPS} steps in {calib['time/wall_s']:.1f} s"
              f" (steady {calib['perf/tokens_per_s_steady']:,.0f} tok/s, overhead {calib['time/overhead_s']:.1f} s)")
        print(f"predicted run:   {PREDICT_STEPS} steps, estimate {predicted:.1f} s, actual {actual:.1f} s"
              f" (its own steady {run['perf/tokens_per_s_steady']:,.0f} tok/s); estimated ${run['cost/estimate_usd']:.4f},"
              f" billed ${run['cost/actual_usd']:.4f} at $1/h")
        print(f"estimate_accuracy: {predicted / actual:.3f}")


if __name__ == "__main__":
    main()
