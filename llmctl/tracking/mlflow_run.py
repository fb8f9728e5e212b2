"""MLflow on the controller side: create the run, describe it, hand it to workers, close it.

The controller owns the run's lifecycle (so a crashed worker still ends FAILED, never RUNNING);
workers only append metrics to the run id they are handed in ``MLFLOW_RUN_ID``.
mlflow is imported inside functions: it is a slow import, and ``--help`` and ``plan`` must not pay it.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator, Optional, TypeVar
from urllib.parse import urlsplit, urlunsplit

from llmctl import __version__
from llmctl.tracking import ui_view

SQLITE_DEFAULT = "mlflow.db"
MAX_PARAM_CHARS = 6000
T = TypeVar("T")


@dataclass
class RunHandle:
    """Everything a worker needs: the run the controller created, and this attempt's environment
    (``workloads.protocol.run_contract``: attempt number, budget guard inputs), set by the lifecycle."""

    uri: str
    run_id: str
    experiment_id: str
    attempt_env: dict[str, str] = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        return {
            "MLFLOW_TRACKING_URI": self.uri,
            "MLFLOW_RUN_ID": self.run_id,
            "MLFLOW_EXPERIMENT_ID": self.experiment_id,
            **self.attempt_env,
        }


def resolve_uri(configured: Optional[str]) -> str:
    """``tracking.uri``, else ``$MLFLOW_TRACKING_URI``, else a sqlite file in the working directory."""
    uri = configured or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        return f"sqlite:///{Path.cwd() / SQLITE_DEFAULT}"
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        # make a relative sqlite path absolute, so workers started elsewhere hit the same file
        return f"sqlite:///{sqlite_path(uri).resolve()}"  # type: ignore[union-attr]
    return uri


def sqlite_path(uri: str) -> Optional[Path]:
    """The file of a ``sqlite:///`` store, or None for any other store."""
    return Path(uri[len("sqlite:///") :]) if uri.startswith("sqlite:///") else None


def missing_store(uri: str, lead: str = "no runs yet") -> Optional[str]:
    """For a sqlite store whose file does not exist, the one line that says so (``no runs yet: no
    tracking store at ./mlflow.db``); None for any other store. Commands that only read (``status``,
    ``runs``, ``cost``, ``resume``...) say it instead of opening the store, which would create it."""
    path = sqlite_path(uri)
    if path is None or path.is_file():
        return None
    try:
        shown = f"./{path.resolve().relative_to(Path.cwd().resolve())}"
    except ValueError:
        shown = str(path)
    return f"{lead}: no tracking store at {shown}"


def redact(value: str) -> str:
    """Strip credentials from URLs (``https://user:token@host`` → ``https://***@host``)."""

    def _one(match: re.Match[str]) -> str:
        parts = urlsplit(match.group(0))
        if parts.username or parts.password:
            host = parts.hostname or ""
            if parts.port:
                host += f":{parts.port}"
            return urlunsplit((parts.scheme, f"***@{host}", parts.path, parts.query, parts.fragment))
        return match.group(0)

    return re.sub(r"[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"]+", _one, value)


def _artifact_location(uri: str) -> Optional[str]:
    """Artifacts beside a local sqlite store, not in whatever directory a worker happens to run."""
    path = sqlite_path(uri)
    return (path.parent / "mlruns").as_uri() if path else None


def _git(cwd: str, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=5, check=True).stdout.strip()


def git_state(path: Optional[Path] = None) -> dict[str, str]:
    """Commit SHA, dirty flag, checkout root and origin URL of the code being run, when it is a git checkout."""
    cwd = str(path or Path.cwd())
    try:
        sha = _git(cwd, "rev-parse", "HEAD")
        dirty = _git(cwd, "status", "--porcelain", "--untracked-files=no")
        root = _git(cwd, "rev-parse", "--show-toplevel")
    except (OSError, subprocess.SubprocessError):
        return {}
    try:
        origin = _git(cwd, "remote", "get-url", "origin")
    except (OSError, subprocess.SubprocessError):
        origin = ""
    return {"git_sha": sha, "git_dirty": str(bool(dirty)).lower(), "root": root, "origin": origin}


MAX_DIFF_BYTES = 1_000_000


def git_diff(root: str) -> str:
    """The uncommitted changes to tracked files (what a dirty run really ran), capped at 1 MB."""
    try:
        return _git(root, "diff", "HEAD")[:MAX_DIFF_BYTES]
    except (OSError, subprocess.SubprocessError):
        return ""


def source_tags(git: dict[str, str]) -> dict[str, str]:
    """MLflow's standard source fields (the run list's Source column, the run page's git commit)."""
    from mlflow.utils import mlflow_tags as t

    tags = {
        t.MLFLOW_SOURCE_TYPE: "PROJECT",
        t.MLFLOW_SOURCE_NAME: git.get("origin") or git["root"],
        t.MLFLOW_GIT_COMMIT: git["git_sha"],
    }
    if git.get("origin"):
        tags[t.MLFLOW_GIT_REPO_URL] = git["origin"]
    return tags


def retry(fn: Callable[..., T], *args: Any, attempts: int = 8, **kwargs: Any) -> T:
    """Call ``fn``; on sqlite's 'database is locked' back off and try again (many writers, one file)."""
    delay = 0.1
    for attempt in range(attempts):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # MlflowException / sqlalchemy OperationalError wrap the same text
            if "locked" not in str(exc).lower() or attempt == attempts - 1:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 3.0)
    raise AssertionError("unreachable")


# MlflowClient calls that leave the store the same when made twice: reads, and writes that set a value
# (a tag, a param, a status, an artifact at a path) rather than add one (a run, a metric point, a version)
IDEMPOTENT_PREFIXES = ("get_", "search_", "list_", "download_")
IDEMPOTENT = {
    "set_tag",
    "delete_tag",
    "log_param",
    "set_terminated",
    "update_run",
    "set_experiment_tag",
    "log_text",
    "log_dict",
    "log_artifact",
    "log_artifacts",
}


def may_repeat(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether the call ``name(*args, **kwargs)`` may be made again after an error that came after it
    may have taken effect (a server that wrote, then failed to answer). ``log_batch`` of tags and
    params only sets values; with metrics it would add their points twice."""
    if name.startswith(IDEMPOTENT_PREFIXES) or name in IDEMPOTENT:
        return True
    if name == "log_batch":
        metrics = kwargs.get("metrics", args[1] if len(args) > 1 else None)
        return not metrics
    return False


class _RetryingClient:
    """An ``MlflowClient`` whose calls ride out a store's write lock: parallel trials, several
    launches at once and their workers all write one sqlite file. On a sqlite store "database is
    locked" is SQLite's busy error: the statement did not run, so any call is safe to make again. On
    any other store a "locked" error may come after the write happened, so only calls that
    ``may_repeat`` are retried (creating a run twice would leave a second run nobody closes)."""

    def __init__(self, inner: Any, sqlite: bool):
        self._inner = inner
        self._sqlite = sqlite

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            if self._sqlite or may_repeat(name, args, kwargs):
                return retry(attr, *args, **kwargs)
            return attr(*args, **kwargs)

        return call


@contextmanager
def _directory_lock(directory: Path) -> Iterator[None]:
    """An exclusive lock on a directory (flock on its descriptor): no lock file left behind."""
    import fcntl

    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def client(uri: str) -> Any:
    """A retrying ``MlflowClient``. A sqlite store is opened under a lock on its directory: MLflow
    creates a new store's schema on first open, and two processes doing that at once collide
    (``table alembic_version already exists``), so several launches in a fresh directory would die."""
    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # resume/eval/export print our lines only
    path = sqlite_path(uri)
    if path is None:
        return _RetryingClient(MlflowClient(tracking_uri=uri), sqlite=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _directory_lock(path.parent), _quiet_store_creation():  # the constructor opens the store (creating it if new)
        if not path.exists():
            from llmctl.tracking.fresh_store import create_from_template

            create_from_template(path)  # a copy of an empty store MLflow made: no migrations to run here
        return _RetryingClient(retry(MlflowClient, tracking_uri=uri), sqlite=True)


def _quiet_store_creation() -> ContextManager[None]:
    """MLflow logs "Creating initial MLflow database tables..." and "Updating database tables" (INFO,
    its own handler) when it creates a sqlite store, and alembic its migrations: the first command in a
    directory would print them. Their loggers say only warnings while the store is opened."""
    from workloads.protocol.quiet_loggers import quiet_loggers

    return quiet_loggers(("mlflow.store.db.utils", "alembic", "alembic.runtime.migration"))


# MLflow 3 opens an experiment on its GenAI overview unless told it holds model training
# (earlier 3.x UIs read this tag, ``mlflow.entities.ExperimentKind``-style values; 3.17's ignores it
# and goes by the page address: RUN_PAGE_QUERY, ui_view)
TAG_EXPERIMENT_KIND = "mlflow.experimentKind"
TRAINING_KIND = "custom_model_development"


def experiment_id(mlflow_client: Any, name: str, uri: str) -> str:
    """The experiment's id, created if missing (a concurrent creator of the same name wins the race),
    marked as a training experiment so MLflow's UI opens it on its runs."""
    exp = mlflow_client.get_experiment_by_name(name)
    if exp is None:
        try:
            mlflow_client.create_experiment(
                name, artifact_location=_artifact_location(uri), tags={TAG_EXPERIMENT_KIND: TRAINING_KIND}
            )
        except Exception:
            pass
        exp = mlflow_client.get_experiment_by_name(name)
        if exp is None:
            raise LookupError(f"MLflow experiment {name!r} could neither be found nor created")
    if TAG_EXPERIMENT_KIND not in exp.tags:  # one created before llmctl set it, or by someone else
        mlflow_client.set_experiment_tag(exp.experiment_id, TAG_EXPERIMENT_KIND, TRAINING_KIND)
    _save_runs_view(mlflow_client, exp)
    return exp.experiment_id


def _save_runs_view(mlflow_client: Any, exp: Any) -> None:
    """The runs-list view ``runs_url`` opens, on the experiment (written once, then found there).
    A convenience of the UI: a store that refuses it (a read-only user, an old server) costs the
    link its columns, never the run."""
    try:
        ui_view.save_view(mlflow_client, exp.experiment_id, exp.tags)
    except Exception:
        pass


def create_run(
    cfg: dict[str, Any], choices: dict[str, Optional[str]], extra_tags: Optional[dict[str, str]] = None
) -> RunHandle:
    """Create the run with provenance tags; ``describe_run`` adds the final config once known."""
    uri = resolve_uri(cfg["tracking"]["uri"])
    if cfg["model"].get("init_from") and "model" in choices:  # its shape and weights are the checkpoint's
        choices = {**choices, "model": cfg["model"]["name"]}
    mc = client(uri)
    exp_id = experiment_id(mc, cfg["tracking"]["experiment"], uri)
    tags = {
        "llmctl.version": __version__,
        "llmctl.infra": cfg["infra"]["name"],
        "llmctl.model": cfg["model"]["name"],
        "llmctl.host": socket.gethostname(),
        "llmctl.status": "launching",
        **{f"llmctl.choice.{k}": str(v) for k, v in choices.items()},
    }
    git = git_state(Path(__file__).resolve().parent)
    if git:
        tags.update({"llmctl.git_sha": git["git_sha"], "llmctl.git_dirty": git["git_dirty"], **source_tags(git)})
    if choices.get("experiment"):
        tags["llmctl.experiment"] = str(choices["experiment"])
    tags.update(extra_tags or {})
    run = mc.create_run(exp_id, run_name=cfg["tracking"]["run_name"], tags={k: redact(v) for k, v in tags.items()})
    if git.get("git_dirty") == "true":
        mc.log_text(run.info.run_id, git_diff(git["root"]), "source/uncommitted.diff")
    return RunHandle(uri=uri, run_id=run.info.run_id, experiment_id=exp_id)


# Config keys whose resolved value is this run's own path (``llmctl-runs/<run id>/checkpoints``): as
# params they would differ between every two runs, so MLflow's Compare view would show them as the
# first "difference" and axis; they are tags (``llmctl.path.<key>``) instead. The YAML keeps them.
PER_RUN_PATHS = ("checkpoint.dir",)
TAG_PATH_PREFIX = "llmctl.path."


def describe_run(handle: RunHandle, cfg: dict[str, Any], resolved_yaml: str) -> None:
    """Params = the flattened resolved config (credentials redacted; for a user's program its own
    sections, ``workload.shown``) but its per-run paths, which are tags; the YAML as an artifact."""
    from mlflow.entities import Param, RunTag

    from llmctl.config.compose import flatten
    from llmctl.config.notify import masked
    from llmctl.config.workload import shown

    mc = client(handle.uri)
    flat = {k: redact(str(v))[:MAX_PARAM_CHARS] for k, v in flatten(shown(masked(cfg))).items()}
    params = [Param(k, v) for k, v in flat.items() if k not in PER_RUN_PATHS]
    paths = [RunTag(TAG_PATH_PREFIX + k, flat[k]) for k in PER_RUN_PATHS if k in flat]
    for i in range(0, len(params), 100):
        mc.log_batch(handle.run_id, params=params[i : i + 100], tags=paths if i == 0 else [])
    mc.log_text(handle.run_id, redact(resolved_yaml), "config.yaml")


def end_run(handle: RunHandle, status: str, reason: str = "", end: Optional[float] = None) -> None:
    """Close the run as FINISHED, FAILED or KILLED (never leave it RUNNING), ending at ``end`` (epoch
    seconds: when its job ended; default now). The terminal status is set whatever became of the
    status tag or the loss curve; the first error is raised after everything was tried."""
    import sys

    mc = client(handle.uri)
    tag_error: Optional[Exception] = None

    def status_tag() -> None:
        mc.set_tag(handle.run_id, "llmctl.status", redact(reason or status.lower())[:5000])

    try:
        status_tag()
    except Exception as exc:
        tag_error = exc
    try:
        log_loss_curve(handle, mc)
    except Exception as exc:  # a picture: never a reason to leave the run open
        print(f"warning: loss_curve.svg not logged ({type(exc).__name__}: {exc})", file=sys.stderr, flush=True)
    mc.set_terminated(handle.run_id, status=status, end_time=int(end * 1000) if end is not None else None)
    if tag_error is not None:  # terminal now; its reason once more, so the tag does not say "running"
        try:
            status_tag()
        except Exception:
            raise tag_error from None


def log_loss_curve(handle: RunHandle, mc: Any = None) -> None:
    """Attach ``loss_curve.svg`` (train and val loss by step) to the run."""
    from llmctl.tracking.loss_plot import loss_curve_svg

    mc = mc or client(handle.uri)
    curves = {
        name: [(m.step, m.value) for m in mc.get_metric_history(handle.run_id, name)]
        for name in ("train/loss", "val/loss")
    }
    mc.log_text(handle.run_id, loss_curve_svg(curves, f"run {handle.run_id}"), "loss_curve.svg")


SLOWER_THAN_ESTIMATED = 1.5  # the closing line says so past this ratio of wall time to the estimate


def summary(handle: RunHandle, elapsed_s: float) -> str:
    """The closing line: how long against the plan's estimate (and saying so when it was much
    slower), how val loss moved."""
    mc = client(handle.uri)
    history = sorted(mc.get_metric_history(handle.run_id, "val/loss"), key=lambda m: m.step)
    loss = f": val/loss {history[0].value:.4f} -> {history[-1].value:.4f}" if history else ""
    return f"llmctl: run {handle.run_id} FINISHED in {elapsed_s:.0f} s{_against_estimate(mc, handle, elapsed_s)}{loss}"


def _against_estimate(mc: Any, handle: RunHandle, elapsed_s: float) -> str:
    """`` (estimated 89 s)``, or `` (estimated 89 s: 2.4x slower)``; "" without an estimate. The plan's
    estimate leaves in-training lm-eval scoring out (``plan`` says so): its time (the trainer's
    ``TASKS_TIME`` metric) is set apart and named, not counted as slowness."""
    from workloads.protocol.lm_eval_results import TASKS_TIME

    try:
        est_s = float(mc.get_run(handle.run_id).data.tags["time/estimate_h"]) * 3600
    except (KeyError, ValueError):
        return ""
    if est_s <= 0:
        return ""
    scoring_s = sum(m.value for m in mc.get_metric_history(handle.run_id, TASKS_TIME))
    apart = f"; lm-eval scoring {scoring_s:.0f} s apart" if scoring_s > 0 else ""
    training_s = elapsed_s - scoring_s
    slower = f": {training_s / est_s:.1f}x slower" if training_s > SLOWER_THAN_ESTIMATED * est_s else ""
    return f" (estimated {est_s:.0f} s{slower}{apart})"


UI_DEFAULT = "http://127.0.0.1:5000"  # where ``mlflow ui`` serves by default
# MLflow 3.17's UI has a GenAI / machine-learning switch (default GenAI) that outranks the experiment's
# kind tag; this query parameter of the page address selects machine learning, so the run page shows runs
RUN_PAGE_QUERY = f"?{ui_view.ML_WORKFLOW}"


def run_page(base: str, experiment: str, run_id: str) -> str:
    """The run's page in MLflow's UI served at ``base``."""
    return f"{base.rstrip('/')}/#/experiments/{experiment}/runs/{run_id}{RUN_PAGE_QUERY}"


def _serves_ui(uri: str) -> bool:
    """Whether the store is a tracking server (its UI at the same address), not a local file."""
    return uri.startswith(("http://", "https://"))


def run_url(handle: RunHandle) -> str:
    """How to look at the run: its page on a tracking server; for a local store, the command that
    serves the UI and the page to open once it runs."""
    if _serves_ui(handle.uri):
        return run_page(redact(handle.uri), handle.experiment_id, handle.run_id)
    return (
        f"mlflow ui --backend-store-uri {handle.uri}, then {run_page(UI_DEFAULT, handle.experiment_id, handle.run_id)}"
    )


def runs_url(handle: RunHandle) -> str:
    """The run's experiment as a runs list with its losses and spend (``ui_view``): on the tracking
    server, or for a local store on the UI that ``run_url``'s command serves."""
    base = redact(handle.uri) if _serves_ui(handle.uri) else UI_DEFAULT
    return ui_view.runs_page(base, handle.experiment_id)
