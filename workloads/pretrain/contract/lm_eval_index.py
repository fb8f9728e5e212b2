"""lm-eval's task index, summarised and cached: what a request check needs of each entry (a leaf task
or a group or tag, its members, its tags, the Hub data set a leaf reads).

lm-eval builds its index by parsing every task YAML it ships (about 14,700 entries; seconds to tens of
seconds of CPU) on every ``TaskManager()``. Its built-in part only changes with lm-eval itself, so its
summary is kept in llmctl's cache (``cache_home()``), keyed by lm-eval's version and install location:
after the first check on a machine, a misspelt task is refused without parsing them again. Tasks of an
include path are indexed on each call (lm-eval alone, without its built-ins: a few files). The
standard library at import; lm-eval when the built-in summary is not cached yet.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlparse

from workloads.protocol.run_contract import cache_home

SUMMARY_FORMAT = 1  # bumped when what a summary holds changes
# datasets' packaged builders: a task whose ``dataset_path`` is one of these reads local files
# (``dataset_kwargs.data_files``), not the Hub
LOCAL_BUILDERS = {"json", "csv", "parquet", "text", "arrow", "pandas"}

Summary = dict[str, dict[str, Any]]


def reads_hub(cfg: dict[str, Any]) -> Optional[str]:
    """The Hub data set a task reads, or None when its data is local (a packaged builder over local
    files, a local directory, or a custom loader)."""
    if cfg.get("custom_dataset"):
        return None
    path = str(cfg.get("dataset_path") or "")
    if not path:
        return None
    if path in LOCAL_BUILDERS:
        files = (cfg.get("dataset_kwargs") or {}).get("data_files") or {}
        urls = files.values() if isinstance(files, dict) else files if isinstance(files, list) else [files]
        flat = [u for v in urls for u in (v if isinstance(v, list) else [v])]
        remote = [u for u in flat if urlparse(str(u)).scheme in ("http", "https", "hf")]
        return str(remote[0]) if remote else None
    return None if Path(path).expanduser().exists() else path


def summarize(index: dict[str, Any]) -> Summary:
    """lm-eval's ``TaskManager.task_index`` as plain JSON: per name, whether it is a leaf task, the
    Hub data set it reads, its members (a group's ``task:`` list), whether it is a tag, its tags."""
    out: Summary = {}
    for name, entry in index.items():
        kind = getattr(getattr(entry, "kind", None), "name", "")
        cfg = entry.cfg if isinstance(entry.cfg, dict) else {}
        leaf = kind == "TASK" or "dataset_path" in cfg
        members = [
            sub if isinstance(sub, str) else str(sub.get("task") or "") if isinstance(sub, dict) else ""
            for sub in (cfg.get("task") or [] if not leaf else [])
        ]
        out[name] = {
            "leaf": leaf,
            "hub": reads_hub(cfg) if leaf else None,
            "members": [m for m in members if m],
            "tag": kind == "TAG",
            "tags": [str(t) for t in (getattr(entry, "tags", None) or ())],
        }
    return out


def leaves(summary: Summary, name: str, depth: int = 0) -> list[dict[str, Any]]:
    """The leaf tasks a task, group or tag name stands for."""
    entry = summary.get(name)
    if entry is None or depth > 8:
        return []
    if entry["leaf"]:
        return [entry]
    members = list(entry["members"])
    if entry["tag"] or not members:
        members += [n for n, e in summary.items() if name in e["tags"]]
    return [leaf for m in members for leaf in leaves(summary, m, depth + 1)]


def complete(summary: Summary, name: str, depth: int = 0) -> bool:
    """Whether ``name`` and every member it stands for (a group's tasks, a tag's) are in ``summary``:
    an index of an include path alone can then run it without lm-eval's built-in tasks."""
    entry = summary.get(name)
    if entry is None or depth > 8:
        return False
    if entry["leaf"]:
        return True
    members = list(entry["members"]) + [n for n, e in summary.items() if name in e["tags"]]
    return bool(members) and all(complete(summary, m, depth + 1) for m in members)


def _cache_file() -> Path:
    import importlib.metadata
    import importlib.util

    spec = importlib.util.find_spec("lm_eval")
    where = str(Path(spec.origin).parent) if spec and spec.origin else "?"
    key = f"{SUMMARY_FORMAT}|{importlib.metadata.version('lm_eval')}|{where}"
    return cache_home() / "lm-eval-index" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def builtin_summary() -> Summary:
    """The summary of lm-eval's own tasks: read from the cache, else built (lm-eval indexes them) and kept."""
    path = _cache_file()
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    from lm_eval.tasks import TaskManager

    summary = summarize(TaskManager().task_index)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(summary))
        os.replace(tmp, path)  # whole or not at all: another process may be reading it
    except OSError:
        pass  # a read-only cache costs the next check the parsing, nothing else
    return summary


def task_summary(include_path: Optional[str]) -> Summary:
    """Every task a request may name: lm-eval's (cached) and those under ``include_path``, which win."""
    summary = builtin_summary()
    if include_path:
        from lm_eval.tasks import TaskManager

        local = TaskManager(include_path=str(Path(include_path).expanduser()), include_defaults=False)
        summary = {**summary, **summarize(local.task_index)}
    return summary
