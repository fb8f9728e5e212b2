"""What a run did cost: billed attempts, recorded as tags on its MLflow run, summed.

One attempt = one span of billed time on one set of nodes (a launch, a managed job's recovery,
a ``resume``). Each is five tags, so any process that provisions nodes appends one without
reading or rewriting the others::

    llmctl.attempt.<n>.start          ISO 8601 UTC time, when billing starts (provisioning / process start)
    llmctl.attempt.<n>.end            ISO 8601 UTC time, when billing stops (teardown / exit); absent while open
    llmctl.attempt.<n>.usd_per_hour   $/h of the whole attempt (all nodes) — the price snapshot, or
                                      "unpriced" (Slurm, local GPUs with no infra.price_per_gpu_hour)
    llmctl.attempt.<n>.nodes          nodes billed
    llmctl.attempt.<n>.devices        priced devices (GPUs; a CPU node counts one)

plus what the attempt was (``infra``, ``served``: what SkyPilot landed it on, for a run over several
``infra.candidates``, ``world_size``, ``from_step``, ``train_steps``, ``status``: its outcome, as
``llmctl.status`` says it). The workload never writes these: it records facts (each start,
``llmctl.workload_start.<k>``), and ``reconcile`` turns a second start under one launcher attempt (a
managed job that SkyPilot recovered on new nodes) into the attempt it was.

    cost/actual_usd       = sum over attempts of hours x usd_per_hour (an open attempt counts to now)
    cost/device_hours     = sum of hours x devices
    cost/usd_per_1m_tokens = cost/actual_usd / (tokens trained / 1e6)

These one-value figures (and the estimate's) are tags of those names, not metrics: a metric is a
time series, and single points would fill MLflow's charts ahead of the loss curves (``figures``
reads them, and a metric of the same name from runs logged before).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Mapping, Optional

from workloads.protocol.run_contract import TAG_START_PREFIX

PREFIX = "llmctl.attempt."
UNPRICED = "unpriced"  # an attempt's usd_per_hour when nobody priced its infra: not counted as $0
TAG_CURRENT = "llmctl.attempt"  # the newest attempt's number
_TAG = re.compile(r"^llmctl\.attempt\.(\d+)\.(start|end|usd_per_hour|nodes|devices)$")


FIGURES = (
    "cost/actual_usd",
    "cost/device_hours",
    "cost/billed_hours",
    "cost/attempts",
    "cost/tokens",
    "cost/usd_per_1m_tokens",
    "cost/estimate_usd",
    "cost/estimate_device_hours",
    "time/estimate_h",
    # what the run measured for the next estimate (``history.calibration``)
    "perf/tokens_per_s_steady",
    "time/val_pass_s",
    "time/wall_s",
    "time/overhead_s",
    "train/steps_done",
)


# Also logged as metrics, so MLflow's runs table sorts by them and its chart view compares runs by
# them; every figure stays a tag too (full precision, and what ``figures`` reads).
CHARTED = ("cost/actual_usd", "cost/device_hours", "cost/usd_per_1m_tokens", "cost/estimate_usd")


def charted_metrics(values: Mapping[str, float], step: int) -> list[Any]:
    """The ``CHARTED`` figures among ``values`` as metrics at ``step`` (0 at launch, then the attempt count)."""
    from mlflow.entities import Metric

    ms = int(time.time() * 1000)
    return [Metric(k, float(v), ms, step) for k, v in values.items() if k in CHARTED]


def figure_tags(values: Mapping[str, float]) -> list[Any]:
    """One-value figures as run tags (full precision, ``repr`` of the float)."""
    from mlflow.entities import RunTag

    return [RunTag(k, repr(float(v))) for k, v in values.items()]


def figures(run: Any) -> dict[str, float]:
    """A run's one-value figures: its tags, else the metrics that runs logged before they were tags."""
    out = {k: v for k, v in run.data.metrics.items() if k in FIGURES}
    for key in FIGURES:
        try:
            out[key] = float(run.data.tags[key])
        except (KeyError, ValueError):
            continue
    return out


def stamp(t: float) -> str:
    """An attempt time as its tag says it: ISO 8601 in UTC, to the millisecond."""
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="milliseconds")


def seconds(value: str) -> float:
    """Epoch seconds of an attempt time tag: ISO 8601, or epoch seconds (runs logged before)."""
    try:
        return float(value)
    except ValueError:
        return datetime.fromisoformat(value).timestamp()


@dataclass
class Attempt:
    n: int
    start: float
    end: Optional[float]
    usd_per_hour: Optional[float]  # None: unpriced
    nodes: int
    devices: int

    def hours(self, now: float) -> float:
        return max(0.0, ((self.end if self.end is not None else now) - self.start) / 3600.0)


@dataclass
class Ledger:
    attempts: list[Attempt]
    actual_usd: float
    device_hours: float
    billed_hours: float
    open: bool
    tokens: Optional[int] = None

    @property
    def unpriced(self) -> int:
        """Attempts on infra nobody priced: their hours count, their dollars are unknown (not $0)."""
        return sum(1 for a in self.attempts if a.usd_per_hour is None)

    @property
    def priced(self) -> bool:
        """Some attempt has a price (all unpriced: there is no dollar figure at all)."""
        return self.unpriced < len(self.attempts) or not self.attempts

    @property
    def usd_per_1m_tokens(self) -> Optional[float]:
        return self.actual_usd / (self.tokens / 1e6) if self.tokens and self.priced else None

    def metrics(self) -> dict[str, float]:
        out = {
            "cost/device_hours": self.device_hours,
            "cost/billed_hours": self.billed_hours,
            "cost/attempts": float(len(self.attempts)),
        }
        if self.priced:
            out["cost/actual_usd"] = self.actual_usd
        if self.tokens:
            out["cost/tokens"] = float(self.tokens)
        if self.usd_per_1m_tokens is not None:
            out["cost/usd_per_1m_tokens"] = self.usd_per_1m_tokens
        return out

    def describe(self) -> str:
        state = " (attempt open: counted to now)" if self.open else ""
        per = f", ${self.usd_per_1m_tokens:,.4f} per 1M tokens" if self.usd_per_1m_tokens is not None else ""
        money = f"${self.actual_usd:,.2f}" if self.priced else UNPRICED
        if self.priced and self.unpriced:
            money += f" (+ {self.unpriced} unpriced attempt(s), not counted)"
        return (
            f"cost:        {money} over {len(self.attempts)} attempt(s){state};"
            f" {self.device_hours:,.3f} device-hours{per}"
        )


def attempts(tags: Mapping[str, str]) -> list[Attempt]:
    """Attempts recorded in a run's tags, in order; malformed or start-less entries are skipped."""
    found: dict[int, dict[str, str]] = {}
    for key, value in tags.items():
        m = _TAG.match(key)
        if m:
            found.setdefault(int(m.group(1)), {})[m.group(2)] = value
    out = []
    for n in sorted(found):
        a = found[n]
        try:
            price = a.get("usd_per_hour", 0) or 0
            out.append(
                Attempt(
                    n=n,
                    start=seconds(a["start"]),
                    end=seconds(a["end"]) if a.get("end") else None,
                    usd_per_hour=None if price == UNPRICED else float(price),
                    nodes=int(a.get("nodes", 1) or 1),
                    devices=int(a.get("devices", 1) or 1),
                )
            )
        except (KeyError, ValueError):
            continue
    return out


def compute(tags: Mapping[str, str], now: Optional[float] = None, tokens: Optional[int] = None) -> Ledger:
    now = time.time() if now is None else now
    found = attempts(tags)
    return Ledger(
        attempts=found,
        actual_usd=sum(a.hours(now) * a.usd_per_hour for a in found if a.usd_per_hour is not None),
        device_hours=sum(a.hours(now) * a.devices for a in found),
        billed_hours=sum(a.hours(now) for a in found),
        open=any(a.end is None for a in found),
        tokens=tokens,
    )


def next_number(tags: Mapping[str, str]) -> int:
    """The number the next attempt gets: one past every attempt recorded so far."""
    return max([a.n for a in attempts(tags)] + [int(tags.get(TAG_CURRENT, "0") or 0)]) + 1


def _price(usd_per_hour: Optional[float]) -> str:
    return UNPRICED if usd_per_hour is None else f"{usd_per_hour:.6f}"


def open_attempt(
    mc: Any,
    run_id: str,
    *,
    usd_per_hour: Optional[float],
    nodes: int,
    devices: int,
    start: Optional[float] = None,
    extra: Optional[Mapping[str, Any]] = None,
) -> int:
    """Append the next attempt (``extra``: infra, world_size, from_step, ...) and return its number."""
    from mlflow.entities import RunTag

    n = next_number(mc.get_run(run_id).data.tags)
    fields = {
        "start": stamp(time.time() if start is None else start),
        "usd_per_hour": _price(usd_per_hour),
        "nodes": str(nodes),
        "devices": str(devices),
        **{k: str(v) for k, v in (extra or {}).items()},
    }
    mc.log_batch(
        run_id, tags=[RunTag(f"{PREFIX}{n}.{k}", v[:5000]) for k, v in fields.items()] + [RunTag(TAG_CURRENT, str(n))]
    )
    return n


TAG_CANDIDATES = "llmctl.candidates"  # JSON: each candidate's price (llmctl.plan.candidates.price_table)


def served_by(table: list[Mapping[str, Any]], where: Mapping[str, Any]) -> Optional[tuple[Optional[float], str]]:
    """($/h, label) of the candidate that ``where`` (a start's cloud, region, zone) is, or None when
    none is: the candidate's catalog price in that region, else its own price. Several that match
    (one provider on demand and spot, in any region): the dearest, as the attempt was opened."""
    cloud, region, zone = str(where.get("cloud") or ""), where.get("region"), where.get("zone")
    found = []
    for c in table:
        if c.get("provider") != cloud or c.get("region") not in (None, region) or c.get("zone") not in (None, zone):
            continue
        price = (c.get("regions") or {}).get(region, c.get("usd_per_hour"))
        found.append((price, str(c.get("label"))))
    if not found:
        return None
    unpriced = [f for f in found if f[0] is None]
    return unpriced[0] if unpriced else max(found, key=lambda f: float(f[0] or 0))


def price_served(mc: Any, run_id: str) -> None:
    """Each attempt of a run over several candidates billed at the one that served it, from where its
    first start says it ran (``llmctl.workload_start.<k>``'s ``where``); an attempt opens at the
    dearest candidate's price, and one whose start says nothing keeps it. Idempotent (``served``)."""
    from mlflow.entities import RunTag

    tags = mc.get_run(run_id).data.tags
    try:
        table = json.loads(tags.get(TAG_CANDIDATES) or "[]")
    except ValueError:
        return
    if not table:
        return
    starts = workload_starts(tags)
    out = []
    for a in attempts(tags):
        if tags.get(f"{PREFIX}{a.n}.served"):
            continue
        seq = tags.get(f"{PREFIX}{a.n}.start_seq")  # an attempt ``reconcile`` opened: its start
        first = next((s for k, s in starts if (str(k) == seq if seq else int(s.get("attempt", 1)) == a.n)), None)
        where = (first or {}).get("where")
        if not where:
            continue
        match = served_by(table, where)
        place = "/".join(str(where.get(k)) for k in ("cloud", "region", "zone") if where.get(k))
        if match is None:
            out.append(RunTag(f"{PREFIX}{a.n}.served", f"{place} (no candidate: billed at the dearest)"))
            continue
        out += [
            RunTag(f"{PREFIX}{a.n}.usd_per_hour", _price(match[0])),
            RunTag(f"{PREFIX}{a.n}.served", f"{match[1]} ({place})"),
        ]
    if out:
        mc.log_batch(run_id, tags=out)


def close_attempt(mc: Any, run_id: str, n: int, end: Optional[float] = None) -> None:
    mc.set_tag(run_id, f"{PREFIX}{n}.end", stamp(time.time() if end is None else end))


def close_open(mc: Any, run_id: str, end: float, status: str = "") -> None:
    """Every attempt still open ends at ``end``; ``status`` (the outcome) goes on those without one."""
    from mlflow.entities import RunTag

    tags = mc.get_run(run_id).data.tags
    out = []
    for a in attempts(tags):
        if a.end is None:
            out.append(RunTag(f"{PREFIX}{a.n}.end", stamp(end)))
            if status and not tags.get(f"{PREFIX}{a.n}.status"):
                out.append(RunTag(f"{PREFIX}{a.n}.status", status[:500]))
    if out:
        mc.log_batch(run_id, tags=out)


def workload_starts(tags: Mapping[str, str]) -> list[tuple[int, dict[str, Any]]]:
    """(k, start) for every ``llmctl.workload_start.<k>`` the workload recorded, in order."""
    found = []
    for key, value in tags.items():
        if key.startswith(TAG_START_PREFIX) and key[len(TAG_START_PREFIX) :].isdigit():
            try:
                found.append((int(key[len(TAG_START_PREFIX) :]), json.loads(value)))
            except ValueError:
                continue
    return sorted(found)


def reconcile(mc: Any, run_id: str) -> Optional[int]:
    """Bill a managed job's recoveries: each start after the first under one launcher attempt (its
    supervisor reran the job on new nodes) closes the attempt before it and opens the next, at the
    same price and size. Idempotent (an attempt remembers its start as ``start_seq``). Returns the
    number of the newest attempt opened here, or None."""
    from mlflow.entities import RunTag

    tags = mc.get_run(run_id).data.tags
    done = {tags[k]: k[: -len(".start_seq")] for k in tags if k.startswith(PREFIX) and k.endswith(".start_seq")}
    by_attempt: dict[int, list[tuple[int, dict[str, Any]]]] = {}
    for k, start in workload_starts(tags):
        by_attempt.setdefault(int(start.get("attempt", 1)), []).append((k, start))
    opened = None
    for launcher_n in sorted(by_attempt):
        for k, start in by_attempt[launcher_n][1:]:
            if str(k) in done:  # billed already; its from_step may have been unknown then (still loading)
                key = f"{done[str(k)]}.from_step"
                if tags.get(key) == "?" and start.get("from_step") is not None:
                    mc.set_tag(run_id, key, str(start["from_step"]))
                continue
            found = {a.n: a for a in attempts(tags)}
            prev = found.get(max(found)) if found else None
            if prev is None:
                continue  # no billed attempt to continue (a run llmctl did not launch)
            t, n = float(start["time"]), next_number(tags)
            new = {
                f"{PREFIX}{n}.{key}": value
                for key, value in {
                    "start": stamp(t),
                    "usd_per_hour": _price(prev.usd_per_hour),
                    "nodes": str(prev.nodes),
                    "devices": str(prev.devices),
                    "infra": tags.get(f"{PREFIX}{prev.n}.infra") or tags.get("llmctl.infra", "?"),
                    "world_size": str(start.get("world_size", "")),
                    "from_step": "?" if start.get("from_step", 0) is None else str(start.get("from_step", 0)),
                    "start_seq": str(k),
                }.items()
            }
            if prev.end is None or prev.end > t:
                new[f"{PREFIX}{prev.n}.end"] = stamp(t)
            new[f"{PREFIX}{prev.n}.status"] = "preempted (recovered by its supervisor)"
            new[TAG_CURRENT] = str(n)
            new["llmctl.status"] = f"recovered: attempt {n} from step {start.get('from_step', 0) or 0}"
            mc.log_batch(run_id, tags=[RunTag(key, value) for key, value in new.items()])
            tags = {**tags, **new}
            opened = n
    price_served(mc, run_id)
    return opened


def tokens_trained(mc: Any, run: Any) -> Optional[int]:
    """Tokens in the final model: last trained step x global batch x seq_len."""
    from llmctl.cost.history import steps_done

    p = run.data.params
    try:
        per_step = int(p["train.batch_size"]) * int(p["train.seq_len"])
    except (KeyError, ValueError):
        return None
    done = steps_done(mc, run.info.run_id)
    return done * per_step if done else None


def update(mc: Any, run_id: str, now: Optional[float] = None) -> Ledger:
    """Recompute the ledger from the run's tags and record it as ``cost/*`` tags (status and run end);
    once every attempt is closed, the charted figures as metrics too, at the attempt count's step."""
    run = mc.get_run(run_id)
    led = compute(run.data.tags, now, tokens_trained(mc, run))
    values = led.metrics()
    charted = [] if led.open else charted_metrics(values, len(led.attempts))
    mc.log_batch(run_id, metrics=charted, tags=figure_tags(values))
    return led
