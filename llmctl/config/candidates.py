"""``infra.candidates``: one run that may land on any of several providers, each written out in full.

A user names the providers (conf/infra files) in preference order, each optionally with its own
keys: ``infra.candidates=[lambda,runpod]`` or ``[{infra: aws, use_spot: true}]``. Composing writes
each one out as the mapping SkyPilot's task will get (``RESOURCE_KEYS``), so the run's recorded
config says exactly what every candidate was. What the job is (nodes, managed, bucket, autostop,
the node install) stays the run's own ``infra`` section's; so does the node's shape (accelerators,
cpus, memory, disk), unless a candidate names its own: the layout and memory plan are sized for it.

SkyPilot does the choosing (``resources.ordered`` or ``resources.any_of``: ``infra.pick``); llmctl
prices, fits and prints every candidate (``llmctl.plan.make``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from llmctl.errors import ConfigError

PICKS = ("ordered", "cheapest")
# what may differ between candidates: where the nodes come from, what they have, what they cost
RESOURCE_KEYS = (
    "name",
    "provider",
    "accelerators",
    "accelerator_aliases",
    "region",
    "zone",
    "use_spot",
    "cpus",
    "memory",
    "disk_size",
    "price_per_gpu_hour",
    "device_memory_gib",
)
# the node's shape: the run's own (its layout and memory plan are sized for it) unless a candidate sets it
NODE_SHAPE = ("accelerators", "cpus", "memory", "disk_size")
# the run's own, whichever candidate serves it (the job's size and life)
JOB_KEYS = ("nodes", "nproc_per_node", "managed", "bucket", "mount_bucket", "autostop_minutes", "down")


def _preset(name: str, dirs: list[Path], i: int) -> dict[str, Any]:
    """conf/infra/<name>.yaml (a user's --config-dir first): a flat mapping."""
    import yaml

    for d in dirs:
        path = d / "infra" / f"{name}.yaml"
        if path.is_file():
            data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
            if data.get("kind") != "sky":
                raise ConfigError(
                    f"Bad value for 'infra.candidates[{i}]': '{name}' runs {data.get('kind')}, not through"
                    " SkyPilot; candidates are SkyPilot providers. Fix: drop it from infra.candidates"
                )
            return dict(data)
    offered = sorted({p.stem for d in dirs for p in (d / "infra").glob("*.yaml")})
    raise ConfigError(
        f"Bad value for 'infra.candidates[{i}]': no infra named '{name}'."
        f" Fix: one of {', '.join(offered)}, or a mapping {{infra: <name>, <key>: <value>}}"
    )


def _one(item: Any, i: int, infra: Mapping[str, Any], dirs: list[Path]) -> dict[str, Any]:
    """Candidate ``i`` written out: its preset's resource keys, the run's accelerators, its own keys."""
    if isinstance(item, str):
        item = {"infra": item}
    if not isinstance(item, Mapping):
        raise ConfigError(
            f"Bad value for 'infra.candidates[{i}]': {item!r}. Fix: an infra name (lambda) or a mapping"
            " {infra: aws, use_spot: true}"
        )
    unknown = sorted(set(item) - {"infra", *RESOURCE_KEYS})
    job = [k for k in unknown if k in JOB_KEYS]
    if job:
        raise ConfigError(
            f"Bad value for 'infra.candidates[{i}]': '{job[0]}' is the whole run's. Fix: infra.{job[0]}={item[job[0]]}"
            " beside infra.candidates (whichever candidate serves the run, it has the same)"
        )
    if unknown:
        raise ConfigError(
            f"Bad value for 'infra.candidates[{i}]': unknown key '{unknown[0]}'."
            f" Fix: a candidate sets only infra and {', '.join(RESOURCE_KEYS)}"
        )
    base: Mapping[str, Any] = _preset(str(item["infra"]), dirs, i) if item.get("infra") else infra
    out = {key: base.get(key) for key in RESOURCE_KEYS}
    out["accelerator_aliases"] = dict(base.get("accelerator_aliases") or {})
    for key in NODE_SHAPE:  # the job's, unless the candidate names its own
        out[key] = infra.get(key)
    out["use_spot"] = bool(base.get("use_spot") or False)
    out.update({k: v for k, v in item.items() if k != "infra"})
    out["name"] = str(out.get("name") or item.get("infra") or infra.get("name"))
    if not out.get("provider"):
        raise ConfigError(f"Bad value for 'infra.candidates[{i}]': no provider. Fix: {{infra: <name>}}")
    return out


def expand(cfg: dict[str, Any], dirs: list[Path]) -> dict[str, Any]:
    """``cfg`` with ``infra.candidates`` written out (unchanged when there are none); ``dirs``: the
    config directories, a user's ``--config-dir`` first."""
    infra = cfg["infra"]
    items = list(infra.get("candidates") or [])
    pick = str(infra.get("pick") or "ordered")
    if pick not in PICKS:
        raise ConfigError(f"Bad value for 'infra.pick': '{pick}'. Fix: infra.pick=ordered or infra.pick=cheapest")
    if not items:
        return cfg
    if infra.get("kind") != "sky":
        raise ConfigError(
            f"Bad value for 'infra.candidates': infra={infra.get('name')} runs here, on one machine."
            " Fix: a SkyPilot infra (infra=lambda infra.candidates=[lambda,runpod]), or infra.candidates=[]"
        )
    written = [_one(item, i, infra, dirs) for i, item in enumerate(items)]
    return {**cfg, "infra": {**infra, "candidates": written}}


def label(candidate: Mapping[str, Any]) -> str:
    """How a candidate is named in plans and messages: ``aws us-east-1 H100:8 spot``."""
    parts = [str(candidate.get("name") or candidate.get("provider"))]
    if candidate.get("region"):
        parts.append(str(candidate["region"]) + (f"/{candidate['zone']}" if candidate.get("zone") else ""))
    parts.append(str(candidate.get("accelerators") or "CPU"))
    if candidate.get("use_spot"):
        parts.append("spot")
    return " ".join(parts)
