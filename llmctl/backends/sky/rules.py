"""Provider rules and offers, checked before anything is provisioned — offline, from SkyPilot itself.

What a provider can do (spot, several nodes per job, autostop, bucket mounts) is what SkyPilot's
cloud class declares (``Cloud._CLOUD_UNSUPPORTED_FEATURES``, with SkyPilot's own reason), and what
it sells is SkyPilot's catalog (the CSVs under ``~/.sky/catalogs``). conf/infra keeps only what
SkyPilot does not know (defaults, accelerator aliases), so a new provider is a new conf/infra
file, not a new branch here. ``sky`` is imported inside functions: ``llmctl --help`` must not pay.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional, Union

from llmctl.backends.sky.facts import remembered
from llmctl.backends.sky.settings import SkySettings
from llmctl.backends.sky.task import node_accelerators
from llmctl.errors import ConfigError

REMOTE_SCHEMES = ("http://", "https://", "databricks")


@dataclass(frozen=True)
class Offer:
    """One way to get the nodes: an instance type in a region, and what it costs per hour."""

    provider: str
    instance_type: str
    region: str
    per_node_hour: float
    nodes: int

    @property
    def total_hour(self) -> float:
        return self.per_node_hour * self.nodes


def _catalog() -> Any:
    import sky.catalog

    return sky.catalog


@contextlib.contextmanager
def _sky_quiet() -> Iterator[None]:
    """SkyPilot's catalog progress (raw ``<sky-payload>`` status lines in-process) and its log lines off:
    what goes wrong reaches the user as an exception that llmctl words (``_catalog_reachable``)."""
    import logging

    from sky import sky_logging

    with sky_logging.silent(), sky_logging.set_sky_logging_levels(logging.CRITICAL):
        yield


def _catalog_reachable(fn: Callable[..., Any]) -> Callable[..., Any]:
    """SkyPilot downloads a provider's catalog on first use; offline, say so instead of a traceback."""

    @functools.wraps(fn)
    def wrapper(infra: Union[SkySettings, Mapping[str, Any]], *args: Any, **kwargs: Any) -> Any:
        settings = SkySettings.of(infra)
        try:
            return fn(settings, *args, **kwargs)
        except Exception as exc:
            import requests  # only now: a remembered answer (sky_facts) never needs it

            if not isinstance(exc, (requests.exceptions.ConnectionError, requests.exceptions.Timeout)):
                raise
            url = getattr(getattr(exc, "request", None), "url", None) or "its catalog URL"
            raise ConfigError(
                f"SkyPilot has no {settings.provider} catalog on this machine and could not download"
                f" it from {url} ({type(exc).__name__}). Fix: run `llmctl plan` once with internet"
                " access, or copy the catalog CSVs into ~/.sky/catalogs/"
            ) from None

    return wrapper


@dataclass(frozen=True)
class Capabilities:
    """What SkyPilot declares a provider cannot do: feature name (``CloudImplementationFeatures``)
    → SkyPilot's reason. Static declarations; SkyPilot's live probes (Slurm's Pyxis or FUSE over
    SSH) run at launch, inside SkyPilot."""

    provider: str
    unsupported: Mapping[str, str]

    def supports(self, feature: str) -> bool:
        return feature not in self.unsupported

    def why_not(self, feature: str) -> str:
        return " ".join(str(self.unsupported.get(feature, "")).split()).rstrip(".")


def capabilities(provider: str) -> Capabilities:
    """``provider``'s unsupported features as its SkyPilot cloud class declares them."""
    return Capabilities(provider, _unsupported_features(provider))


@remembered
def _unsupported_features(provider: str) -> dict[str, str]:
    from sky.utils import registry

    cloud = registry.CLOUD_REGISTRY.from_str(provider)
    declared = getattr(type(cloud), "_CLOUD_UNSUPPORTED_FEATURES", {}) or {}
    return {getattr(f, "name", str(f)): str(reason) for f, reason in declared.items()}


@remembered
def known_providers() -> list[str]:
    from sky.utils import registry

    return sorted(registry.CLOUD_REGISTRY.keys())


def tracking_refusal(infra_name: str, tracking_uri: str) -> Optional[str]:
    """Why ``launch`` refuses this store for remote nodes (None: they can reach it). ``plan`` shows it
    and still shows the whole plan; ``preflight`` raises it."""
    if tracking_uri.startswith(REMOTE_SCHEMES):
        return None
    return (
        f"infra '{infra_name}' runs on remote nodes, which cannot reach the local MLflow store {tracking_uri}."
        " Fix: run a tracking server the nodes can reach (e.g. `mlflow server --host 0.0.0.0 --port 5000`)"
        " and set tracking.uri=http://<that-host>:5000 (or MLFLOW_TRACKING_URI)"
    )


CLOUD_EXTRA = "pip install 'llmctl-train[cloud]'"


def require_sky(infra_name: str) -> None:
    """SkyPilot is the optional ``cloud`` extra: without it, a cloud or Slurm plan is refused in one
    line naming the extra, not with the ``ModuleNotFoundError`` of whichever rule imports ``sky``
    first. ``find_spec`` looks for the package without importing it (``import sky`` costs seconds)."""
    import importlib.util

    try:
        found = importlib.util.find_spec("sky") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ConfigError(
            f"infra={infra_name} runs through SkyPilot, which is not installed in this Python ({sys.executable})."
            f" Fix: {CLOUD_EXTRA} (from a checkout: pip install -e '.[cloud]'), or infra=local"
        )


def check(cfg: Mapping[str, Any], settings: Optional[SkySettings] = None) -> None:
    """Every rule a provider states in its infra config, plus the catalog's accelerator list.
    ``settings``: the plan's (default: built from ``cfg["infra"]``)."""
    require_sky(str(cfg["infra"].get("name") or cfg["infra"].get("provider")))
    infra = settings or SkySettings.from_cfg(cfg)
    provider = infra.provider
    if not provider or provider not in known_providers():
        raise ConfigError(
            f"Bad value for 'infra.provider': '{provider}' is not a SkyPilot provider."
            f"{_did_you_mean(str(provider), known_providers())}"
            f" Fix: infra.provider=<one of: aws, lambda, runpod, slurm, ...>"
            f" (all: {', '.join(known_providers())})"
        )
    can = capabilities(provider)
    if infra.nodes > 1 and not can.supports("MULTI_NODE"):
        raise ConfigError(
            f"Bad value for 'infra.nodes': {provider} runs at most 1 node per job"
            f" (SkyPilot: {can.why_not('MULTI_NODE')}), got {infra.nodes}."
            f" Fix: infra.nodes=1, or pick a multi-node infra (aws, lambda, slurm)"
        )
    if infra.use_spot and not can.supports("SPOT_INSTANCE"):
        raise ConfigError(
            f"Bad value for 'infra.use_spot': {provider} has no spot instances"
            f" (SkyPilot: {can.why_not('SPOT_INSTANCE')})."
            " Fix: infra.use_spot=false, or pick an infra with spot (aws, runpod)"
        )
    if infra.autostop_minutes is not None and not infra.managed and not can.supports("AUTOSTOP"):
        raise ConfigError(
            f"Bad value for 'infra.autostop_minutes': {provider} has no autostop"
            f" (SkyPilot: {can.why_not('AUTOSTOP')}). Fix: infra.autostop_minutes=null"
            " (llmctl releases the nodes when the run ends when infra.down=true)"
        )
    if infra.bucket and infra.mount_bucket and not can.supports("STORAGE_MOUNTING"):
        raise ConfigError(
            f"Bad value for 'infra.mount_bucket': {provider} cannot mount a bucket"
            f" (SkyPilot: {can.why_not('STORAGE_MOUNTING')}). Fix: infra.mount_bucket=false"
            " (the workload then writes checkpoints to the bucket URL itself)"
        )
    _check_region(infra)
    _check_accelerators(infra)


def _did_you_mean(word: str, options: list[str]) -> str:
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.5)
    return f" Did you mean '{close[0]}'?" if close else ""


@_catalog_reachable
def _check_region(infra: SkySettings) -> None:
    if not infra.region or not _has_offline_catalog(infra.provider):
        return
    problem = _region_problem(infra.provider, infra.region, infra.zone)
    if problem:
        raise ConfigError(f"Bad value for 'infra.region'/'infra.zone': {problem}")


@remembered
def _region_problem(provider: str, region: str, zone: Optional[str]) -> Optional[str]:
    """SkyPilot's own message when the catalog has no such region/zone, else None."""
    try:
        with _sky_quiet():
            _catalog().validate_region_zone(region, zone, clouds=provider)
    except ValueError as exc:
        return " ".join(str(exc).split())
    return None


@remembered
def _has_offline_catalog(provider: str) -> bool:
    """Slurm (and Kubernetes) learn what they offer from the live cluster, not from a CSV."""
    import importlib

    try:
        with _sky_quiet():  # some providers' catalog modules read (and fetch) their CSV on import
            module = importlib.import_module(f"sky.catalog.{provider}_catalog")
    except ImportError:
        return False
    return hasattr(module, "get_instance_type_for_accelerator")


@_catalog_reachable
def _check_accelerators(infra: SkySettings) -> None:
    acc = node_accelerators(infra)
    provider = infra.provider
    if acc is None or not _has_offline_catalog(provider):
        return
    name, count = acc
    counts = _accelerator_counts(provider)
    if name not in counts:
        offered = ", ".join(f"{g}:{'/'.join(str(int(c)) for c in cs)}" for g, cs in sorted(counts.items()))
        raise ConfigError(
            f"Bad value for 'infra.accelerators': {provider} has no '{name}'."
            f"{_did_you_mean(name, list(counts))} {provider} offers {offered}"
            f" (SkyPilot catalog). Fix: infra.accelerators=<NAME>:<count>"
        )
    if count not in {int(c) for c in counts[name]}:
        raise ConfigError(
            f"Bad value for 'infra.accelerators': {provider} has no node with {count}x {name};"
            f" it offers {name} in counts of {', '.join(str(int(c)) for c in counts[name])}"
            f" per node. Fix: infra.accelerators={name}:<count> and more infra.nodes"
        )


@remembered
def _accelerator_counts(provider: str) -> dict[str, list[int]]:
    with _sky_quiet():
        counts = _catalog().list_accelerator_counts(gpus_only=True, clouds=provider)
    return {name: [int(c) for c in cs] for name, cs in counts.items()}


@remembered
def accelerator_memory_gib(provider: Optional[str], gpu: str) -> Optional[float]:
    """One ``gpu``'s memory as SkyPilot's catalog lists it (None: not listed, or no catalog here). A
    provider without an offline catalog (Slurm) is not asked: its catalog is the live cluster, which a
    plan does not contact (SkyPilot would also write its state database for it)."""
    if provider and not _has_offline_catalog(provider):
        return None
    try:
        with _sky_quiet():
            found = _catalog().list_accelerators(gpus_only=True, name_filter=gpu, clouds=provider, case_sensitive=False)
    except Exception:
        return None
    sizes = [
        _gib(i.device_memory)
        for infos in found.values()
        for i in infos
        if i.device_memory and str(i.accelerator_name).lower() == gpu.lower()
    ]
    return min(sizes) if sizes else None


def _gib(listed: float) -> float:
    """SkyPilot's ``device_memory`` (GiB: the catalog's ``SizeInMiB`` / 1024). RunPod's catalog writes
    GiB into ``SizeInMiB`` (an H100 SXM: ``80``, read as 0.08 GiB); no GPU has under 1 GiB, so such a
    figure is the GiB it was written as."""
    return listed * 1024 if listed < 1 else listed


# Whose catalogs size a GPU for a provider that sells none (Slurm): the clouds conf/infra ships.
MEMORY_CATALOG_CLOUDS = ("aws", "lambda", "runpod")


def listed_memory_gib(gpu: str) -> tuple[Optional[float], list[str]]:
    """(GiB, clouds): the memory of a ``gpu`` by that name in SkyPilot's cloud catalogs, for a
    provider whose catalog lists none (Slurm: a GRES name such as ``H100`` says the chip, never its
    memory). Trusted because it is the table the aws/lambda/runpod plans already hold jobs against,
    kept by SkyPilot per instance type from the providers' own GPU descriptions, so a Slurm H100 and
    a cloud H100 are planned alike. Where the clouds disagree (one name, several memory variants)
    the smallest wins: a job that fits it fits every variant, and a cluster with a larger one says
    so with ``infra.device_memory_gib``. (None, []) when no catalog here lists the name (offline,
    without the catalogs: SkyPilot downloads them as for a cloud plan)."""
    found = {cloud: accelerator_memory_gib(cloud, gpu) for cloud in MEMORY_CATALOG_CLOUDS}
    sizes = {cloud: gib for cloud, gib in found.items() if gib}
    if not sizes:
        return None, []
    least = min(sizes.values())
    return least, [cloud for cloud, gib in sizes.items() if gib == least]


@_catalog_reachable
def offers(infra: SkySettings) -> list[Offer]:
    """Every instance type and region that fits, priced by SkyPilot's catalog, cheapest first.
    ``infra``: the plan's settings; a plain ``infra`` section works too (``_catalog_reachable``
    types it)."""
    provider = str(infra.provider)  # check() refused a missing one
    if not _has_offline_catalog(provider):
        return []
    acc = node_accelerators(infra)
    rows = _offer_rows(
        provider,
        list(acc) if acc else None,
        infra.cpus,
        infra.memory,
        bool(infra.use_spot),
        infra.region,
        infra.zone,
    )
    found = [Offer(provider, itype, reg, price, int(infra.nodes)) for itype, reg, price in rows]
    return sorted(found, key=lambda o: (o.total_hour, o.region, o.instance_type))


@remembered
def _offer_rows(
    provider: str,
    acc: Optional[list[Any]],
    cpus: Any,
    memory: Any,
    spot: bool,
    region: Optional[str],
    zone: Optional[str],
) -> list[tuple[str, str, float]]:
    """(instance type, region, $/h per node) of every fit, as SkyPilot's catalog answers."""
    with _sky_quiet():
        cat = _catalog()
        if acc:
            types, _ = cat.get_instance_type_for_accelerator(
                acc[0], acc[1], cpus=cpus, memory=memory, use_spot=spot, region=region, zone=zone, clouds=provider
            )
        else:
            default = cat.get_default_instance_type(
                cpus=cpus, memory=memory, region=region, zone=zone, use_spot=spot, clouds=provider
            )
            types = [default] if default else []
        found = []
        for itype in types or []:
            for reg in cat.get_region_zones_for_instance_type(itype, spot, clouds=provider):
                if region and reg.name != region:
                    continue
                price = cat.get_hourly_cost(itype, spot, reg.name, zone, clouds=provider)
                found.append((itype, reg.name, float(price)))
    return found


def check_credentials(provider: str) -> None:
    """What ``sky check <provider>`` reports, in-process, before any MLflow run or cluster exists."""
    from sky.clouds import CloudCapability
    from sky.utils import registry

    cloud = registry.CLOUD_REGISTRY.from_str(provider)
    ok, reason = cloud.check_credentials(CloudCapability.COMPUTE)
    if ok:
        return
    if isinstance(reason, dict):
        reason = "; ".join(f"{k}: {v}" for k, v in reason.items())
    detail = " ".join(str(reason or "no credentials").split())
    raise ConfigError(
        f"{provider} is not usable: {detail}. Fix: set up {provider} credentials"
        f" (docs/providers/{provider}.md), then confirm with `sky check {provider}`"
    )


# Where a provider's plan tells users to keep checkpoints that must outlive the nodes (provider data,
# read by the plan's note): a Slurm cluster has a shared filesystem, as conf/infra/slurm.yaml says
KEEP_CHECKPOINTS = {
    "slurm": "point checkpoint.dir at the cluster's shared filesystem to keep them"
    " (checkpoint.dir=/shared/<you>/checkpoints), or set infra.bucket=s3://...",
}
KEEP_CHECKPOINTS_DEFAULT = "set infra.bucket=s3://... to keep them"


def keep_checkpoints(provider: Optional[str]) -> str:
    """The plan's advice for checkpoints that should outlive ``provider``'s nodes."""
    return KEEP_CHECKPOINTS.get(str(provider), KEEP_CHECKPOINTS_DEFAULT)


def format_offers(found: list[Offer], infra: Optional[Mapping[str, Any]] = None) -> str:
    if not found:  # llmctl prices it by infra.price_per_gpu_hour (cost.estimate.configured_price)
        priced = infra is not None and infra.get("price_per_gpu_hour") is not None
        how = "priced by infra.price_per_gpu_hour" if priced else "unpriced until infra.price_per_gpu_hour is set"
        return f"(none in SkyPilot's offline catalog for this provider: {how})"
    lines = [f"{'provider':<9} {'instance type':<24} {'region':<14} {'$/h per node':>13} {'$/h total':>10}"]
    for o in found:
        lines.append(
            f"{o.provider:<9} {o.instance_type:<24} {o.region:<14} {o.per_node_hour:>13.2f} {o.total_hour:>10.2f}"
        )
    return "\n".join(lines)
