"""``llmctl resume RUN_ID [OVERRIDES]``: continue a stopped run from its newest complete checkpoint,
in the same MLflow run, here or on other infra, at the same or another world size (docs/resume.md).

Order: find the run → its config (the ``config.yaml`` artifact: the config it last ran with) →
re-compose it with the overrides through the normal compose/validate path → plan → preflight →
the checkpoint it will start from → reopen the run (RUNNING, attempt n) → backend.launch →
close the run (FINISHED / KILLED when preempted again / FAILED).

Attempts are tags, in the cost ledger's format (``llmctl/cost/ledger.py``: start, end,
usd_per_hour, nodes, devices) plus ``infra``, ``world_size``, ``from_step`` and ``status``;
``llmctl.attempt`` is the current attempt number.
"""

from __future__ import annotations

import json
import os
import re
import signal
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

from llmctl.errors import ConfigError, LaunchError
from llmctl.procs import pid_alive

EXIT_PREEMPTED = 75  # launch/resume: the run was preempted (SIGTERM) with its state saved; resume it
TAG_PREEMPTED = "llmctl.preempted"  # JSON written by the workload's rank 0 (workloads/pretrain/preempt.py)
TAG_ATTEMPT = "llmctl.attempt"
TAG_BACKEND = "llmctl.backend"  # backend of the latest attempt (params keep the first attempt's infra.kind)
ATTEMPT_ENV = "LLMCTL_ATTEMPT"
_STEP_DIR = re.compile(r"^step-(\d+)$")
# groups whose sections are re-derived when changed; experiment/model cannot change under a checkpoint
RESECTION = {"infra": ("infra", "parallel"), "parallel": ("parallel",), "data": ("data",), "train": ("train",)}


# ----------------------------------------------------------------------------- checkpoints


def latest_complete(root: str) -> Optional[int]:
    """Newest ``step-N`` under ``root`` with its ``.complete`` marker (fsspec only: no torch here)."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(root)
    fs.invalidate_cache()
    if not fs.exists(path):
        return None
    done = []
    for entry in fs.ls(path, detail=False):
        m = _STEP_DIR.match(entry.rstrip("/").rsplit("/", 1)[-1])
        if m and fs.exists(f"{entry.rstrip('/')}/.complete"):
            done.append(int(m.group(1)))
    return max(done) if done else None


# ----------------------------------------------------------------------------- config


def _hydra_value(v: Any) -> str:
    """A resolved value as Hydra override text (strings quoted, so paths and URLs survive)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_hydra_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{_hydra_value(x)}" for k, x in v.items()) + "}"
    return "'" + str(v).replace("\\", "\\\\").replace("'", "\\'") + "'"


def compose_resume(stored: dict[str, Any], choices: dict[str, str], overrides: list[str],
                   config_dir: Optional[str] = None) -> Any:
    """The stored config + overrides, through ``config.compose`` (same checks, same messages).

    Compose input: the run's group choices, then every stored value as ``key=value``, then the
    user's overrides. A group override (``infra=aws``) drops the stored values of its sections so
    the new option's values apply (changing infra re-derives ``parallel`` too: its stored values are
    the old machine's layout). ``model=`` and ``experiment=`` are refused: a checkpoint only loads
    into the model that wrote it.
    """
    from llmctl.config import GROUPS, parse_overrides, compose, flatten

    user = list(overrides)
    dropped: set[str] = set()
    for raw, ov in zip(user, parse_overrides(user)):
        group = ov.key_or_group
        if group in ("model", "experiment"):
            raise ConfigError(f"'{raw}': a resumed run keeps its {group} (its checkpoint only loads into the"
                              f" same model); set individual keys instead, or launch a new run")
        if group in GROUPS:
            dropped.update(RESECTION.get(group, (group,)))
    base = [f"{g}={c}" for g, c in choices.items()
            if g in GROUPS and g not in ("experiment",) and g not in dropped and c not in (None, "None", "null")]
    base += [f"{k}={_hydra_value(v)}" for k, v in flatten(stored).items() if k.split(".")[0] not in dropped]
    return compose(base + user, config_dir)


def _stored_config(mc: Any, run: Any) -> dict[str, Any]:
    from omegaconf import OmegaConf

    with tempfile.TemporaryDirectory() as tmp:
        try:
            path = mc.download_artifacts(run.info.run_id, "config.yaml", tmp)
        except Exception as exc:  # noqa: BLE001 - MlflowException or OSError: same message
            raise ConfigError(f"run {run.info.run_id} has no config.yaml artifact ({type(exc).__name__}); it was"
                              " not launched by llmctl, or its artifact store is unreachable") from None
        return OmegaConf.to_container(OmegaConf.load(path))  # type: ignore[return-value]


# ----------------------------------------------------------------------------- outcome


def preempted_reason(handle: Any) -> Optional[str]:
    """``preempted at step N — resume with: llmctl resume ID`` when the workload tagged a preemption."""
    from llmctl.tracking import client

    try:
        raw = client(handle.uri).get_run(handle.run_id).data.tags.get(TAG_PREEMPTED)
    except Exception:  # noqa: BLE001
        return None
    if not raw:
        return None
    try:
        info = json.loads(raw)
    except ValueError:
        info = {}
    ck = info.get("checkpoint")
    saved = f"checkpoint step-{ck}" if ck is not None else "no checkpoint: resume restarts from step 0"
    return (f"preempted at step {info.get('step', '?')} ({saved}) — resume with: llmctl resume {handle.run_id}")


def finish_attempt(handle: Any, attempt: Optional[int], status: str) -> None:
    if attempt is None:
        return
    from llmctl.tracking import client

    try:
        client(handle.uri).set_tag(handle.run_id, f"llmctl.attempt.{attempt}.status", status[:500])
    except Exception:  # noqa: BLE001 - bookkeeping only
        pass


# ----------------------------------------------------------------------------- resume


def _check_not_running(run: Any, backend: Any) -> None:
    if run.info.status != "RUNNING":
        return
    rid = run.info.run_id
    if backend.__name__.endswith(".local"):
        pids = backend._pids(rid)
        if not (pid_alive(pids.get("controller")) or pid_alive(pids.get("workers"))):
            return  # its controller died without closing it: safe to take over
        raise ConfigError(f"run {rid} is still running (controller pid {pids.get('controller')}); stop it"
                          f" first: llmctl down {rid}")
    raise ConfigError(f"run {rid} is still RUNNING on {run.data.tags.get('llmctl.infra', '?')}; stop it first"
                      f" (llmctl down {rid}) so two jobs never write one checkpoint directory")


def _reopen(mc: Any, run: Any, plan: Any, from_step: int) -> tuple[int, dict[str, str]]:
    """Close the bookkeeping of the previous attempt, open attempt n; returns (n, worker env)."""
    from mlflow.entities import RunTag

    from llmctl.cost import hooks as cost
    from llmctl.cost import ledger

    rid, tags, now = run.info.run_id, run.data.tags, time.time()
    found = ledger.attempts(tags)
    prev_n = max([a.n for a in found] + [int(tags.get(TAG_ATTEMPT, "1") or 1)])
    out = {}
    if found and found[-1].end is None:
        end = (run.info.end_time or now * 1000) / 1000
        out[f"{ledger.PREFIX}{found[-1].n}.end"] = f"{end:.3f}"
    for key, value in (("infra", tags.get("llmctl.infra", "?")),
                       ("world_size", tags.get(f"{ledger.PREFIX}{prev_n}.world_size")
                        or _world_size(run.data.params)),
                       ("status", (tags.get("llmctl.status") or run.info.status.lower())[:500])):
        if not tags.get(f"{ledger.PREFIX}{prev_n}.{key}") and value:
            out[f"{ledger.PREFIX}{prev_n}.{key}"] = str(value)
    n = prev_n + 1
    est = getattr(plan, "estimate", None)
    price = est.price.usd_per_hour if est else 0.0
    hw = est.hw if est else None
    out.update({f"{ledger.PREFIX}{n}.{k}": v for k, v in {
        "start": f"{now:.3f}", "usd_per_hour": f"{price:.6f}", "nodes": str(hw.nodes if hw else plan.nodes),
        "devices": str(hw.devices if hw else plan.world_size), "infra": plan.cfg["infra"]["name"],
        "world_size": str(plan.world_size), "from_step": str(from_step)}.items()})
    out.update({TAG_ATTEMPT: str(n), "llmctl.infra": plan.cfg["infra"]["name"], TAG_BACKEND: plan.backend,
                "llmctl.status": f"resuming: attempt {n} from step {from_step}"})
    mc.log_batch(rid, tags=[RunTag(k, v) for k, v in out.items()])
    if tags.get(TAG_PREEMPTED):
        mc.delete_tag(rid, TAG_PREEMPTED)
    mc.update_run(rid, status="RUNNING")
    spent = ledger.compute({**tags, **out}, now).actual_usd
    env = {cost.ENV_BILLING_START: f"{now:.3f}", cost.ENV_PRICE: f"{price:.6f}", cost.ENV_SPENT: f"{spent:.6f}",
           ATTEMPT_ENV: str(n)}
    if tags.get("llmctl.max_cost_usd"):
        env[cost.ENV_MAX_COST] = tags["llmctl.max_cost_usd"]
    return n, env


def _world_size(params: dict[str, str]) -> str:
    try:
        return str(int(params["parallel.dp_replicate"]) * int(params["parallel.dp_shard"]) * int(params["parallel.tp"]))
    except (KeyError, ValueError):
        return ""


def resume(run_id: str, overrides: list[str], config_dir: Optional[str], tracking_uri: Optional[str],
           echo: Callable[[str], None]) -> int:
    """The whole command; returns the exit code. ConfigError (→ 3) before anything is changed."""
    from llmctl import runs, tracking
    from llmctl.backends import backend_for
    from llmctl.config import Composed, to_yaml
    from llmctl.plan import make_plan

    uri = runs.tracking_uri(tracking_uri)
    run = runs.get_run(run_id, uri)
    mc = tracking.client(uri)
    _check_not_running(run, runs.backend_of(run))
    stored = _stored_config(mc, run)
    choices = {k[len("llmctl.choice."):]: v for k, v in run.data.tags.items() if k.startswith("llmctl.choice.")}
    composed = compose_resume(stored, choices, overrides, config_dir)
    plan = make_plan(Composed(cfg=composed.cfg, choices=choices, overrides=overrides))
    backend = backend_for(plan.cfg["infra"]["kind"])
    getattr(backend, "preflight", lambda p: None)(plan)
    root = plan.cfg["checkpoint"]["dir"]
    if not root:
        raise ConfigError(f"run {run_id} has no checkpoint.dir: there is nothing to resume from; launch it again")
    try:
        step = latest_complete(str(root))
    except Exception as exc:  # noqa: BLE001 - unreachable bucket, bad credentials ...
        raise ConfigError(f"cannot list checkpoints in {tracking.redact(str(root))}: {type(exc).__name__}: {exc}") from None
    total = int(plan.cfg["train"]["steps"])
    if step is not None and step >= total and run.info.status != "FINISHED":
        # the work is done (e.g. killed after its last checkpoint): close the run, nothing to rerun
        handle = tracking.RunHandle(uri=uri, run_id=run_id, experiment_id=run.info.experiment_id)
        tracking.end_run(handle, "FINISHED", f"finished: complete checkpoint at step {step} of {total}")
        echo(f"llmctl: run {run_id} already has its final checkpoint (step {step} of {total}); marked FINISHED")
        return 0
    if step is not None and step >= total:
        raise ConfigError(f"run {run_id} already has a complete checkpoint at step {step} of train.steps={total}:"
                          f" nothing to resume. To train further, raise it: llmctl resume {run_id} train.steps=<N>")

    handle = tracking.RunHandle(uri=uri, run_id=run_id, experiment_id=run.info.experiment_id)
    attempt, env = _reopen(mc, run, plan, step or 0)
    cfg = backend.finalize(plan, handle)
    mc.log_text(run_id, tracking.redact(to_yaml(cfg)), "config.yaml")  # what the next resume reads
    mc.log_text(run_id, tracking.redact(to_yaml(cfg)), f"attempts/{attempt}/config.yaml")
    os.environ.update(env)
    where = (f"from step {step} ({tracking.redact(str(root))})" if step is not None else
             f"from step 0: no complete checkpoint in {tracking.redact(str(root))}, so the run restarts"
             " within the same MLflow run")
    echo(f"llmctl: resuming run {run_id} (attempt {attempt}) {where} on {plan.where},"
         f" {plan.world_size} process(es) on {plan.device}")
    return _run_attempt(backend, plan, handle, attempt, echo)


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _run_attempt(backend: Any, plan: Any, handle: Any, attempt: int, echo: Callable[[str], None]) -> int:
    from llmctl import tracking
    from llmctl.cost import hooks as cost

    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    started = time.monotonic()
    try:
        code = backend.launch(plan, handle)
    except KeyboardInterrupt:
        finish_attempt(handle, attempt, "interrupted")
        tracking.end_run(handle, "KILLED", "interrupted")
        echo(f"error: run {handle.run_id} interrupted; marked KILLED")
        return 130
    except (LaunchError, OSError) as exc:
        finish_attempt(handle, attempt, "failed to start")
        tracking.end_run(handle, "FAILED", str(exc))
        echo(f"error: run {handle.run_id} failed to start: {exc}")
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
        cost.on_end(handle, plan, attempt)  # closes llmctl.attempt.<n>.end and refreshes the ledger
    if code != 0:
        reason = preempted_reason(handle)
        if reason:
            finish_attempt(handle, attempt, "preempted")
            tracking.end_run(handle, "KILLED", reason)
            echo(f"error: run {handle.run_id} {reason}")
            return EXIT_PREEMPTED
        finish_attempt(handle, attempt, f"failed: exit {code}")
        tracking.end_run(handle, "FAILED", f"workload exited with code {code}")
        log = getattr(backend, "run_dir", lambda r: Path("."))(handle.run_id) / "output.log"
        echo(f"error: run {handle.run_id} FAILED: workload exited with code {code} (log: {log})")
        return 1
    finish_attempt(handle, attempt, "finished")
    tracking.end_run(handle, "FINISHED")
    echo(tracking.summary(handle, time.monotonic() - started))
    return 0
