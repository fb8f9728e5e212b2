"""``llmctl smoke``: the whole pipeline on a CPU in about a minute, as a CI gate.

launch (half the steps, checkpoint) → resume (the rest, same MLflow run) → eval (the final
checkpoint) → check that val loss fell by at least a margin. Each stage runs the same command a
user types, in a subprocess, so the gate tests what users run. Results can be written as JUnit
XML for CI systems.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

HALF_STEPS = 20
RUN_ID = re.compile(r"llmctl: run ([0-9a-f]{32})")


@dataclass
class Stage:
    name: str
    seconds: float = 0.0
    failure: Optional[str] = None
    output: str = ""


@dataclass
class SmokeResult:
    stages: list[Stage] = field(default_factory=list)
    run_id: Optional[str] = None
    first_val: Optional[float] = None
    final_val: Optional[float] = None

    @property
    def ok(self) -> bool:
        return bool(self.stages) and all(s.failure is None for s in self.stages)


def _llmctl(args: list[str], echo: Callable[[str], None]) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, "-m", "llmctl", *args], capture_output=True, text=True)
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        echo(output[-4000:])
    return proc.returncode, output


def _stage(result: SmokeResult, name: str, args: list[str], echo: Callable[[str], None]) -> Stage:
    echo(f"smoke: {name}: llmctl {' '.join(args)}")
    started = time.monotonic()
    code, output = _llmctl(args, echo)
    stage = Stage(name, time.monotonic() - started, None if code == 0 else f"exit code {code}", output)
    result.stages.append(stage)
    return stage


def _val_losses(run_id: str, uri: Optional[str]) -> tuple[list[float], Optional[float], dict[str, str]]:
    from llmctl.tracking.mlflow_run import client, resolve_uri

    mc = client(resolve_uri(uri))
    history = sorted(mc.get_metric_history(run_id, "val/loss"), key=lambda m: m.step)
    evals = mc.get_metric_history(run_id, "eval/val_loss")
    run = mc.get_run(run_id)
    return [m.value for m in history], (evals[-1].value if evals else None), run.data.tags


def run_smoke(
    overrides: list[str], min_loss_drop: float, tracking_uri: Optional[str], echo: Callable[[str], None]
) -> SmokeResult:
    """Run the stages in order; stop at the first that fails (later ones would only repeat it)."""
    result = SmokeResult()
    uri_args = [f"tracking.uri={tracking_uri}"] if tracking_uri else []
    launch = _stage(
        result,
        "launch",
        [
            "launch",
            "experiment=smoke",
            f"train.steps={HALF_STEPS}",
            f"checkpoint.every={HALF_STEPS}",
            *uri_args,
            *overrides,
        ],
        echo,
    )
    match = RUN_ID.search(launch.output)
    result.run_id = match.group(1) if match else None
    if launch.failure or not result.run_id:
        launch.failure = launch.failure or "no run id in launch output"
        return result
    uri_opt = ["--tracking-uri", tracking_uri] if tracking_uri else []
    resume = _stage(result, "resume", ["resume", result.run_id, f"train.steps={2 * HALF_STEPS}", *uri_opt], echo)
    if resume.failure:
        return result
    if f"resumed from step {HALF_STEPS}" not in resume.output:
        resume.failure = f"resume did not start from the step-{HALF_STEPS} checkpoint"
        return result
    ev = _stage(result, "eval", ["eval", result.run_id, *uri_opt], echo)
    if ev.failure:
        return result
    check = Stage("loss_check")
    result.stages.append(check)
    vals, eval_loss, tags = _val_losses(result.run_id, tracking_uri)
    if len(vals) < 2:
        check.failure = "fewer than two val/loss points were logged"
        return result
    result.first_val, result.final_val = vals[0], vals[-1]
    drop = vals[0] - vals[-1]
    if drop < min_loss_drop:
        check.failure = (
            f"val/loss fell by {drop:.3f} ({vals[0]:.3f} -> {vals[-1]:.3f}), "
            f"less than --min-loss-drop {min_loss_drop}: training is broken or too weak"
        )
    elif eval_loss is None or abs(eval_loss - vals[-1]) > 1e-4:
        check.failure = f"eval/val_loss {eval_loss} differs from the run's final val/loss {vals[-1]:.6f}"
    elif tags.get("llmctl.attempt") != "2":
        check.failure = f"expected one MLflow run with 2 attempts, tag llmctl.attempt={tags.get('llmctl.attempt')}"
    return result


def junit_xml(result: SmokeResult) -> str:
    """One <testcase> per stage, in the format CI systems read."""
    failures = sum(s.failure is not None for s in result.stages)
    suite = ET.Element(
        "testsuite",
        name="llmctl-smoke",
        tests=str(len(result.stages)),
        failures=str(failures),
        time=f"{sum(s.seconds for s in result.stages):.2f}",
    )
    for stage in result.stages:
        case = ET.SubElement(suite, "testcase", classname="llmctl.smoke", name=stage.name, time=f"{stage.seconds:.2f}")
        if stage.failure:
            ET.SubElement(case, "failure", message=stage.failure).text = stage.output[-4000:]
    return ET.tostring(suite, encoding="unicode")


def summary(result: SmokeResult) -> str:
    lines = [
        f"  {s.name:<11} {'ok' if s.failure is None else 'FAILED: ' + s.failure} ({s.seconds:.1f} s)"
        for s in result.stages
    ]
    if result.first_val is not None and result.final_val is not None:
        lines.append(f"  val/loss    {result.first_val:.4f} -> {result.final_val:.4f}")
    verdict = "passed" if result.ok else "FAILED"
    head = f"llmctl smoke {verdict} (run {result.run_id or 'n/a'}, {sum(s.seconds for s in result.stages):.0f} s)"
    return "\n".join([head, *lines])


def write_junit(result: SmokeResult, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(junit_xml(result))
