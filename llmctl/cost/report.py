"""``llmctl runs`` and ``llmctl cost``: read MLflow, print rich tables (or JSON).

Spend is recomputed from each run's ledger tags (so a RUNNING run counts to now, and a run whose
``cost/actual_usd`` was never refreshed is still right); the estimate is the ``cost/estimate_usd`` tag.
"""

from __future__ import annotations

import re
import time
from datetime import datetime, timezone
from typing import Any, Optional

from llmctl.cost import ledger
from llmctl.errors import ConfigError

GROUPS = ("experiment", "infra", "accelerator")
_SPAN = re.compile(r"^(\d+(?:\.\d+)?)([mhdw])$")
_UNIT_S = {"m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_ATTEMPT_STEPS = re.compile(rf"^{re.escape(ledger.PREFIX)}(\d+)\.train_steps$")


def since_epoch(since: Optional[str], now: Optional[float] = None) -> Optional[float]:
    """``7d``, ``12h``, ``30m``, ``2w`` ago, or an ISO date/time (UTC if no zone); None: all time."""
    if not since:
        return None
    now = time.time() if now is None else now
    m = _SPAN.match(since.strip())
    if m:
        return now - float(m.group(1)) * _UNIT_S[m.group(2)]
    try:
        dt = datetime.fromisoformat(since.strip())
    except ValueError:
        raise ConfigError(f"--since '{since}': use a span (30m, 12h, 7d, 2w) or a date (2026-11-01)") from None
    return (dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)).timestamp()


def fetch(
    uri: str, since: Optional[float] = None, experiment: Optional[str] = None, limit: int = 1000
) -> list[tuple[Any, str]]:
    """(run, experiment name) newest first, across experiments (or one), started since ``since``."""
    from llmctl.cost.history import store_exists
    from llmctl.tracking.mlflow_run import client

    if not store_exists(uri):
        return []
    mc = client(uri)
    exps = {e.experiment_id: e.name for e in mc.search_experiments()}
    if experiment:
        exps = {k: v for k, v in exps.items() if v == experiment}
    if not exps:
        return []
    query = f"attributes.start_time >= {int(since * 1000)}" if since else ""
    found: list[Any] = []
    token = None
    while len(found) < limit:  # pages of 1000: the store caps one request
        page = mc.search_runs(
            list(exps),
            query,
            max_results=min(1000, limit - len(found)),
            order_by=["attributes.start_time DESC"],
            page_token=token,
        )
        found.extend(page)
        token = page.token
        if not token:
            break
    return [(r, exps.get(r.info.experiment_id, r.info.experiment_id)) for r in found]


# a user's program (``workload=command``) logs its loss under its own name: the usual ones, in order
# (transformers' Trainer: loss / eval_loss; Lightning and plain loops: train_loss / val_loss)
LOSS_NAMES = ("train/loss", "loss", "train_loss")
VAL_LOSS_NAMES = ("val/loss", "eval_loss", "val_loss", "eval/loss", "validation_loss")


def _named(metrics: Any, names: tuple[str, ...]) -> tuple[Optional[float], Optional[str]]:
    """(value, its name) of the first of ``names`` the run logged; the name is None for llmctl's own."""
    found = next((n for n in names if n in metrics), None)
    if found is None:
        return None, None
    return metrics[found], (None if found == names[0] else found)


def run_row(run: Any, experiment: str, now: Optional[float] = None) -> dict[str, Any]:
    tags, params, m = run.data.tags, run.data.params, run.data.metrics
    train_loss, loss_name = _named(m, LOSS_NAMES)
    val_loss, val_loss_name = _named(m, VAL_LOSS_NAMES)
    fig = ledger.figures(run)
    led = ledger.compute(tags, now, int(fig["cost/tokens"]) if fig.get("cost/tokens") else None)
    steps = fig.get("train/steps_done")
    return {
        "run_id": run.info.run_id,
        "name": run.info.run_name,
        "experiment": experiment,
        "status": run.info.status,
        "detail": tags.get("llmctl.status", ""),
        "pruned": "llmctl.pruned" in tags,  # a sweep's pruner stopped it (its status is KILLED)
        "infra": tags.get("llmctl.infra", params.get("infra.name", "?")),
        "accelerator": tags.get("llmctl.accelerator", "?" if ledger.attempts(tags) else "-"),  # "-": never ran
        "nodes": int(params.get("infra.nodes", 1) or 1),
        "start": (run.info.start_time or 0) / 1000.0,
        "steps": int(steps) if steps is not None else None,
        "steps_target": _steps_target(tags, params),
        "train_loss": train_loss,
        "loss_name": loss_name,  # None: llmctl's train/loss; else the program's own metric name
        "val_loss": val_loss,
        "val_loss_name": val_loss_name,
        "tokens_per_s": fig.get("perf/tokens_per_s_steady", m.get("perf/tokens_per_s")),
        "mfu": m.get("perf/mfu"),
        "estimate_usd": fig.get("cost/estimate_usd"),
        "estimate_h": fig.get("time/estimate_h"),
        "actual_usd": led.actual_usd if led.attempts and led.priced else None,
        "unpriced": bool(led.attempts and not led.priced) or tags.get("llmctl.price.usd_per_hour") == ledger.UNPRICED,
        "wall_h": led.billed_hours if led.attempts else None,
        "device_hours": led.device_hours if led.attempts else None,
        "usd_per_1m_tokens": led.usd_per_1m_tokens,
        "tokens": led.tokens,
        "attempts": len(led.attempts),
    }


def _steps_target(tags: Any, params: Any) -> Optional[int]:
    """``train.steps`` of the newest attempt that recorded it: a resume may train further than the
    launch did, and MLflow keeps the first attempt's params."""
    found = {int(m.group(1)): tags[k] for k in tags if (m := _ATTEMPT_STEPS.match(k))}
    return _int(found[max(found)]) if found else _int(params.get("train.steps"))


def _int(v: Any) -> Optional[int]:
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def runs_rows(
    uri: str, since: Optional[str] = None, experiment: Optional[str] = None, limit: int = 50
) -> list[dict[str, Any]]:
    now = time.time()
    rows = [run_row(r, e, now) for r, e in fetch(uri, since_epoch(since, now), experiment, limit)]
    programs = [row for row in rows if not row["steps"] and row["loss_name"]]
    if programs:  # a program's loss: the step it was last logged at (its history; one client for all)
        from llmctl.tracking.mlflow_run import client

        mc = client(uri)
        for row in programs:
            history = mc.get_metric_history(row["run_id"], row["loss_name"])
            row["steps"] = max(p.step for p in history) if history else None
    return rows


def cost_rows(uri: str, since: Optional[str] = None, by: str = "experiment") -> list[dict[str, Any]]:
    """Spend grouped by experiment, infra or accelerator, most expensive first, with a total row."""
    if by not in GROUPS:
        raise ConfigError(f"--by '{by}': one of {', '.join(GROUPS)}")
    groups: dict[str, dict[str, Any]] = {}
    total = {
        by: "TOTAL",
        "runs": 0,
        "unpriced_runs": 0,
        "actual_usd": 0.0,
        "estimate_usd": 0.0,
        "device_hours": 0.0,
        "tokens": 0,
    }
    for row in runs_rows(uri, since, limit=100000):
        if not row["attempts"]:  # a sweep's parent, a trial never started: nothing ran, no run to count
            continue
        g = groups.setdefault(
            str(row[by]),
            {
                by: str(row[by]),
                "runs": 0,
                "unpriced_runs": 0,
                "actual_usd": 0.0,
                "estimate_usd": 0.0,
                "device_hours": 0.0,
                "tokens": 0,
            },
        )
        for acc in (g, total):
            acc["runs"] += 1
            acc["unpriced_runs"] += bool(row["unpriced"])  # counted apart: an unpriced run is not a $0 run
            acc["actual_usd"] += row["actual_usd"] or 0.0
            acc["estimate_usd"] += row["estimate_usd"] or 0.0
            acc["device_hours"] += row["device_hours"] or 0.0
            acc["tokens"] += row["tokens"] or 0
    out = sorted(groups.values(), key=lambda g: -g["actual_usd"]) + ([total] if groups else [])
    for g in out:
        g["usd_per_1m_tokens"] = g["actual_usd"] / (g["tokens"] / 1e6) if g["tokens"] else None
    return out


# ----------------------------------------------------------------------------- rendering


def _money(v: Optional[float], unpriced: bool = False) -> str:
    return ledger.UNPRICED if v is None and unpriced else "-" if v is None else f"${v:,.2f}"


def _num(v: Optional[float], fmt: str = "{:.4f}") -> str:
    return "-" if v is None else fmt.format(v)


def _loss(v: Optional[float], name: Optional[str]) -> str:
    """A loss, with the program's own metric name when it is not llmctl's (``4.8572 (eval_loss)``)."""
    return _num(v) + (f" ({name})" if v is not None and name else "")


def render(title: str, header: list[str], rows: list[list[str]], right: set[int]) -> str:
    """A rich table as text (rich imported here only); wide enough not to wrap when piped."""
    import io

    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_lines=False, header_style="bold")
    for i, h in enumerate(header):
        table.add_column(h, justify="right" if i in right else "left", no_wrap=True)
    for r in rows:
        table.add_row(*r)
    buf = io.StringIO()
    Console(file=buf, width=250, color_system=None, highlight=False).print(table)
    return "\n".join(line.rstrip() for line in buf.getvalue().splitlines())


def runs_table(rows: list[dict[str, Any]]) -> str:
    header = [
        "run",
        "name",
        "status",
        "infra",
        "accelerator",
        "steps",
        "loss",
        "val loss",
        "tok/s",
        "MFU",
        "est $",
        "actual $",
        "est h",
        "actual h",
    ]
    body = []
    for r in rows:
        status = r["status"] + (" (budget stop)" if r["detail"].startswith("stopped: budget") else "")
        status = "PRUNED" if r.get("pruned") else status
        steps = f"{r['steps'] if r['steps'] is not None else '-'}/{r['steps_target'] if r['steps_target'] else '?'}"
        body.append(
            [
                r["run_id"][:12],
                r["name"] or "",
                status,
                r["infra"],
                r["accelerator"],
                steps,
                _loss(r["train_loss"], r.get("loss_name")),
                _loss(r["val_loss"], r.get("val_loss_name")),
                _num(r["tokens_per_s"], "{:,.0f}"),
                _num(None if r["mfu"] is None else 100 * r["mfu"], "{:.1f}%"),
                _money(r["estimate_usd"], r["unpriced"]),
                _money(r["actual_usd"], r["unpriced"]),
                _num(r["estimate_h"], "{:.3f}"),
                _num(r["wall_h"], "{:.3f}"),
            ]
        )
    return render(f"{len(rows)} run(s)", header, body, right=set(range(5, 14)))


def cost_table(rows: list[dict[str, Any]], by: str, since: Optional[str]) -> str:
    header = [by, "runs", "actual $", "estimated $", "device-hours", "tokens", "$ per 1M tokens"]
    body = [
        [
            str(g[by]),
            str(g["runs"]) + (f" ({g['unpriced_runs']} unpriced)" if g["unpriced_runs"] else ""),
            _money(g["actual_usd"]),
            _money(g["estimate_usd"]),
            f"{g['device_hours']:,.3f}",
            f"{g['tokens']:,}",
            _money(g["usd_per_1m_tokens"]),
        ]
        for g in rows
    ]
    return render(
        f"spend by {by}" + (f" since {since}" if since else " (all time)"), header, body, right=set(range(1, 7))
    )
