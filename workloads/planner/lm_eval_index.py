"""lm-eval's task index, summarised and cached: what a request check needs of each entry (a leaf task
or a group or tag, its members, its tags, the Hub data set a leaf reads).

lm-eval builds its index by parsing every task YAML it ships (about 14,700 entries; seconds to tens of
seconds of CPU) on every ``TaskManager()``. Its built-in part only changes with those files, so its
summary is keyed by them (each task file's path and size: ``_files_key``, a fraction of a second to
read) and found, in order: in llmctl's cache (``cache_home()``); shipped with llmctl for the lm-eval
the project pins (``lm_eval_indexes/``, made by ``python -m workloads.planner.lm_eval_index``),
so even a machine's first check refuses a misspelt task without parsing them; else built by lm-eval
and cached. An lm-eval whose task files differ (another version, a task added in place) gets its own
key, never a summary of other files. Tasks of an include path are indexed on each call (lm-eval alone,
without its built-ins: a few files). The standard library at import; lm-eval only to build a summary.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlparse

from workloads.protocol.run_contract import cache_home

SUMMARY_FORMAT = 1  # bumped when what a summary holds changes
# summaries shipped with llmctl (gzip'd JSON named by their key): the pinned lm-eval's, made at release
SHIPPED = Path(__file__).with_name("lm_eval_indexes")
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
            "tags": sorted(str(t) for t in (getattr(entry, "tags", None) or ())),  # a set in lm-eval
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


def _files_key() -> str:
    """What a built-in summary is a summary of: lm-eval's task files, each by its path (relative to
    lm-eval's ``tasks`` folder) and size, with the summary's format."""
    import importlib.util

    spec = importlib.util.find_spec("lm_eval")
    tasks = Path(spec.origin).parent / "tasks" if spec and spec.origin else Path("?")
    digest = hashlib.sha256(f"{SUMMARY_FORMAT}\n".encode())
    for folder, subfolders, files in os.walk(tasks):
        subfolders.sort()
        for name in sorted(files):
            if name.endswith((".yaml", ".yml")):
                path = os.path.join(folder, name)
                digest.update(f"{os.path.relpath(path, tasks)}\0{os.path.getsize(path)}\n".encode())
    return digest.hexdigest()[:16]


def build_builtin_summary() -> Summary:
    """lm-eval indexes its built-in tasks (the slow part), summarised."""
    from lm_eval.tasks import TaskManager

    return summarize(TaskManager().task_index)


def builtin_summary() -> Summary:
    """The summary of lm-eval's own tasks: cached, else shipped, else built (lm-eval indexes them) and cached."""
    key = _files_key()
    path = cache_home() / "lm-eval-index" / f"{key}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    try:
        return json.loads(gzip.decompress((SHIPPED / f"{key}.json.gz").read_bytes()))
    except (OSError, ValueError):
        pass
    summary = build_builtin_summary()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(summary))
        os.replace(tmp, path)  # whole or not at all: another process may be reading it
    except OSError:
        pass  # a read-only cache costs the next check the parsing, nothing else
    return summary


def ship() -> Path:
    """Write the installed lm-eval's summary where llmctl ships it (run after changing lm-eval's pin)."""
    SHIPPED.mkdir(exist_ok=True)
    path = SHIPPED / f"{_files_key()}.json.gz"
    data = json.dumps(build_builtin_summary(), sort_keys=True).encode()
    path.write_bytes(gzip.compress(data, mtime=0))  # the same bytes for the same summary
    return path


def task_summary(include_path: Optional[str]) -> Summary:
    """Every task a request may name: lm-eval's (cached) and those under ``include_path``, which win."""
    summary = builtin_summary()
    if include_path:
        from lm_eval.tasks import TaskManager

        local = TaskManager(include_path=str(Path(include_path).expanduser()), include_defaults=False)
        summary = {**summary, **summarize(local.task_index)}
    return summary


if __name__ == "__main__":
    print(ship())
