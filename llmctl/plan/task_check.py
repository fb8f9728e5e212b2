"""``eval.tasks`` preflight: the lm-eval tasks a run scores during training exist and can read their
data, checked before the run exists (exit 3, one line), at launch, resume and sweep launch.

Only when ``eval.tasks`` names any: lm-eval indexes its thousands of task YAMLs to answer (seconds),
which a launch without tasks never pays. The check is ``check_tasks``, the one ``llmctl eval --tasks``
runs: an unknown task, a Hub task where the Hub cannot be reached
from here, lm-eval not installed here.

Checked where the scoring runs (``on_nodes``): a run on a cloud or Slurm scores on its nodes, which
install lm-eval and read the Hub themselves, so this machine needs neither; its names are still
checked here when lm-eval is installed here (a misspelt task costs no cluster), and the job checks
them again on the node (``workloads.pretrain.score_tasks``).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlparse

from llmctl.errors import ConfigError

OFFLINE_ENV = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
NO_TASK = "no task named: --tasks T1,T2 (lm-eval task, group or tag names)"
LM_EVAL_MISSING = "lm-eval is not installed: pip install 'llmctl-train[eval]' (lm-evaluation-harness), then run again"


def check_plan(plan: Any) -> None:
    ev = plan.cfg.get("eval") or {}
    tasks = list(ev.get("tasks") or [])
    if not tasks:
        return
    why = check_tasks(tasks, ev.get("include_path"), flag="eval.include_path=", on_nodes=plan.backend != "local")
    if why:
        raise ConfigError(f"eval.tasks: {why}")


def hub_unreachable(timeout_s: float = 5.0) -> Optional[str]:
    """Why the Hugging Face Hub cannot be read from here, or None: offline mode set, or no TCP
    connection to ``HF_ENDPOINT`` (default huggingface.co) within ``timeout_s``."""
    for var in OFFLINE_ENV:
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return f"{var} is set"
    endpoint = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = endpoint.hostname or "huggingface.co", endpoint.port or (80 if endpoint.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as exc:
        return f"no connection to {host}:{port} ({type(exc).__name__})"
    return None


def check_tasks(
    tasks: list[str], include_path: Optional[str], flag: str = "--include-path", on_nodes: bool = False
) -> Optional[str]:
    """One line saying what is wrong with ``tasks``, or None: lm-eval missing, an unknown task (with
    lm-eval's closest names), a task reading the Hub where the Hub cannot be reached. ``flag``: how
    the caller's user names the include path (``--include-path``, ``eval.include_path=``).
    ``on_nodes``: the scoring runs on a cluster's nodes, not here: lm-eval missing here and the Hub
    out of reach from here are theirs to answer, not refusals."""
    if not tasks:
        return NO_TASK
    flag += "" if flag.endswith("=") else " "
    if include_path and not Path(include_path).expanduser().is_dir():
        return f"{flag}{include_path}: no such directory (lm-eval task YAMLs)"
    try:
        import lm_eval  # noqa: F401  (the package alone: its task index is what costs)
    except ImportError:
        return None if on_nodes else LM_EVAL_MISSING
    import difflib

    from workloads.planner.lm_eval_index import leaves, task_summary

    index = task_summary(include_path)
    unknown = [t for t in tasks if t not in index]
    if unknown:
        close = difflib.get_close_matches(unknown[0], list(index), n=3)
        hint = f" Did you mean: {', '.join(close)}?" if close else ""
        local = "" if include_path else f"; a task of your own: {flag}DIR with its YAML"
        return f"unknown lm-eval task '{unknown[0]}'.{hint} Fix: `lm_eval ls tasks` lists them{local}"
    hub = [(t, leaf["hub"]) for t in tasks for leaf in leaves(index, t) if leaf["hub"]]
    if hub and not on_nodes:
        why = hub_unreachable()
        if why:
            task, ds = hub[0]
            return (
                f"task '{task}' reads its data set '{ds}' from the Hugging Face Hub, which cannot be reached"
                f" from here ({why}). Fix: run where the Hub is reachable, or point a task YAML at local"
                f" files (dataset_path: json, data_files) and pass {flag}DIR"
            )
    return None
