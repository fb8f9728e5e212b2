"""How close is llmctl's wall-time estimate? Calibrate on one run here, predict two others, run them.

    python benchmarks/estimate_accuracy.py

Each of ``ROUNDS`` rounds, in a fresh store:

1. prime the tokenizer/corpus cache and create the store (so no run pays for building either);
2. calibration run: ``llmctl launch`` of the smoke model for CALIB_STEPS steps (local, CPU);
3. (a) a 4x longer run of the same shape: its estimate cites the calibration run;
   (b) a different shape with at least 4x the FLOPs per token (``BIGGER``): no run of that shape
   exists, so this checks the estimator's fallback for a new shape (the calibration run's FLOP/s,
   transferred: ``llmctl/cost/estimate.py``);
   (c) the calibration shape with ``parallel.ac=full`` (``RECOMPUTE``): another shape key, so the
   calibration run's FLOP/s is transferred to the work per token with each block's forward
   recomputed (``llmctl/cost/work.py``): checks the recompute term;
   (d) a second, larger shape (``BIGGEST``: dim 384, 8 layers, ~11x the calibration FLOPs per
   token): the store now holds runs of two hidden sizes (128 and (b)'s 256) in its regime, so its
   estimate scales FLOP/s by ``1/F = a + b/d`` fitted over them (``estimate.fit_sizes``), at a size
   no run of the fit had: checks the fit where (b) checks the prior;
4. each is launched; the estimate it logged (``time/estimate_h``) is compared with its billed wall
   time (``time/wall_s``, the ledger's attempt).
Prints the ratios (predicted / actual) of every round, and last their medians over the rounds
(goals 0.90-1.10 for (a), 0.75-1.25 for (b), (c) and (d) on a quiet machine):
``estimate_accuracy: <a> (4x length), <b> (4x FLOPs/token), <c> (ac=full), <d> (11x FLOPs/token)``.

Why rounds: on these 2-core VMs a process draws its speed when it starts. Identical launches,
one after another with nothing else running, differ from each other while each is flat within
itself and a matmul loop beside them holds steady (figures in docs/benchmarks.md): per-process
placement, not load, and no software setting changed it (glibc malloc thresholds did not). So one
round's ratio is mostly two draws of that noise, calibration and actual; the median
of five rounds is the estimator's own error.
Everything lives in temp dirs; its run time is in docs/benchmarks.md.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CALIB_STEPS, LONGER_STEPS, BIGGER_STEPS = 30, 120, 30
ROUNDS = 5
BIGGER = ["model.dim=256", "model.n_layers=6"]  # 4.3x the smoke shape's training FLOPs per token at seq 128
RECOMPUTE, RECOMPUTE_STEPS = ["parallel.ac=full"], 60
BIGGEST, BIGGEST_STEPS = ["model.dim=384", "model.n_layers=8"], 20  # 11x the smoke shape's FLOPs per token
COMMON = [
    "model=smoke",
    "train.batch_size=16",
    "train.seq_len=128",
    "train.log_every=5",
    "train.val_every=25",
    "checkpoint.every=0",
    "infra.price_per_gpu_hour=1.0",
]


def llmctl(args: list[str], cwd: Path, env: dict[str, str]) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "llmctl", *args], check=False, cwd=cwd, env=env, text=True, capture_output=True
    )
    if out.returncode != 0:
        sys.exit(f"llmctl {' '.join(args)} failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return out.stdout


def prime_cache(cwd: Path, env: dict[str, str]) -> None:
    """The corpus built, the store created (its schema migrations take seconds): one-off costs that
    the first run would otherwise be charged for and the estimator would learn as overhead."""
    code = (
        "from omegaconf import OmegaConf; from llmctl.config.compose import compose;"
        "from workloads.pretrain.data import prepare_corpus;"
        f"prepare_corpus(OmegaConf.create(compose({COMMON!r}).cfg['data']));"
        "import mlflow; mlflow.MlflowClient().search_experiments()"
    )
    subprocess.run([sys.executable, "-c", code], cwd=cwd, env={**env, "PYTHONPATH": str(ROOT)}, check=True)


def one_round(show_plans: bool) -> dict[str, float]:
    """Calibrate, then plan and launch both cases in a fresh store; predicted / actual of each."""
    from mlflow.tracking import MlflowClient

    from llmctl.cost.ledger import figures

    with tempfile.TemporaryDirectory(prefix="llmctl-estimate-") as tmp:
        work = Path(tmp)
        uri = f"sqlite:///{work / 'mlflow.db'}"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "LLMCTL_"))}
        env.update({"MLFLOW_TRACKING_URI": uri, "LLMCTL_CACHE_DIR": str(work / "cache"), "PYTHONUNBUFFERED": "1"})
        prime_cache(work, env)

        llmctl(["launch", *COMMON, f"train.steps={CALIB_STEPS}", "tracking.run_name=calibration"], work, env)
        cases = {
            "longer": [f"train.steps={LONGER_STEPS}"],
            "bigger": [*BIGGER, f"train.steps={BIGGER_STEPS}"],
            "recompute": [*RECOMPUTE, f"train.steps={RECOMPUTE_STEPS}"],
            "biggest": [*BIGGEST, f"train.steps={BIGGEST_STEPS}"],  # after (b): two sizes to fit
        }
        for name, extra in cases.items():
            plan = llmctl(["plan", *COMMON, *extra], work, env)
            if show_plans:
                print(f"--- {name}: llmctl plan {' '.join(extra)}")
                print(plan[plan.index("# cost estimate") :].rstrip())
            llmctl(["launch", *COMMON, *extra, f"tracking.run_name={name}"], work, env)

        mc = MlflowClient(uri)
        runs = {r.info.run_name: r for r in mc.search_runs([e.experiment_id for e in mc.search_experiments()])}
        calib = figures(runs["calibration"])
        print(
            f"calibration run: {CALIB_STEPS} steps in {calib['time/wall_s']:.1f} s"
            f" (steady {calib['perf/tokens_per_s_steady']:,.0f} tok/s, overhead {calib['time/overhead_s']:.1f} s)"
        )
        ratios = {}
        for name in cases:
            m = figures(runs[name])
            predicted, actual = m["time/estimate_h"] * 3600, m["time/wall_s"]
            ratios[name] = predicted / actual
            print(
                f"  {name}: estimate {predicted:.1f} s, actual {actual:.1f} s (its own steady"
                f" {m['perf/tokens_per_s_steady']:,.0f} tok/s, overhead {m['time/overhead_s']:.1f} s):"
                f" predicted/actual {ratios[name]:.3f}"
            )
        return ratios


def main() -> None:
    rounds = []
    for i in range(ROUNDS):
        print(f"=== round {i + 1}/{ROUNDS}", flush=True)
        rounds.append(one_round(show_plans=i == 0))
    keys = ("longer", "bigger", "recompute", "biggest")
    a, b, c, d = (statistics.median(r[k] for r in rounds) for k in keys)
    each = {k: ", ".join(f"{r[k]:.3f}" for r in rounds) for k in keys}
    print(
        f"rounds (4x length): {each['longer']}; (4x FLOPs/token): {each['bigger']}; (ac=full): {each['recompute']};"
        f" (11x FLOPs/token): {each['biggest']}"
    )
    print(
        f"estimate_accuracy: {a:.3f} (4x length), {b:.3f} (4x FLOPs/token), {c:.3f} (ac=full),"
        f" {d:.3f} (11x FLOPs/token)"
    )


if __name__ == "__main__":
    main()
