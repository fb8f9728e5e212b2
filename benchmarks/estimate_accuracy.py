"""How close is llmctl's wall-time estimate? Calibrate on one run here, predict two others, run them.

    python benchmarks/estimate_accuracy.py

1. prime the tokenizer/corpus cache (so no run pays for building it);
2. calibration run: ``llmctl launch`` of the smoke model for CALIB_STEPS steps (local, CPU);
3. (a) a 4x longer run of the same shape: its estimate cites the calibration run;
   (b) a different shape with at least 4x the FLOPs per token (``BIGGER``): no run of that shape
   exists, so this checks the estimator's fallback for a new shape (the calibration run's FLOP/s,
   transferred: ``llmctl/cost/estimate.py``);
4. each is launched; the estimate it logged (``time/estimate_h``) is compared with its billed wall
   time (``time/wall_s``, the ledger's attempt).
Prints both ratios (predicted / actual; goals 0.90-1.10 for (a), 0.75-1.25 for (b) on a quiet
machine). Last line: ``estimate_accuracy: <a> (4x length), <b> (4x FLOPs/token)``.
Everything lives in a temp dir; takes several minutes on a 2-core machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CALIB_STEPS, LONGER_STEPS, BIGGER_STEPS = 30, 120, 30
BIGGER = ["model.dim=256", "model.n_layers=6"]  # 4.3x the smoke shape's training FLOPs per token at seq 128
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
        cases = {"longer": [f"train.steps={LONGER_STEPS}"], "bigger": [*BIGGER, f"train.steps={BIGGER_STEPS}"]}
        for name, extra in cases.items():
            plan = llmctl(["plan", *COMMON, *extra], work, env)
            print(f"--- {name}: llmctl plan {' '.join(extra)}")
            print(plan[plan.index("# cost estimate"):].rstrip())
            llmctl(["launch", *COMMON, *extra, f"tracking.run_name={name}"], work, env)

        mc = MlflowClient(uri)
        runs = {r.info.run_name: r for r in mc.search_runs([e.experiment_id for e in mc.search_experiments()])}
        from llmctl.cost.ledger import figures

        calib = figures(runs["calibration"])
        print(f"calibration run: {CALIB_STEPS} steps in {calib['time/wall_s']:.1f} s"
              f" (steady {calib['perf/tokens_per_s_steady']:,.0f} tok/s, overhead {calib['time/overhead_s']:.1f} s)")
        ratios = {}
        for name in cases:
            m = figures(runs[name])
            predicted, actual = m["time/estimate_h"] * 3600, m["time/wall_s"]
            ratios[name] = predicted / actual
            print(f"{name}: estimate {predicted:.1f} s, actual {actual:.1f} s (its own steady"
                  f" {m['perf/tokens_per_s_steady']:,.0f} tok/s): predicted/actual {ratios[name]:.3f}")
        print(f"estimate_accuracy: {ratios['longer']:.3f} (4x length), {ratios['bigger']:.3f} (4x FLOPs/token)")


if __name__ == "__main__":
    main()
