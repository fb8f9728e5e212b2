"""What the SkyPilot backend reads of ``infra``, typed: ``SkySettings``, built once per plan.

The user-visible keys stay ``infra.*`` (``llmctl.config.root_schema.InfraCfg``, conf/infra/*.yaml);
this is the SkyPilot backend's view of them, one field per key it reads, as NeMo-Run has one
executor dataclass per backend. Stdlib only: ``llmctl plan`` builds it without importing ``sky``.
Defaults equal ``InfraCfg``'s (tests/llmctl/test_backend_settings.py holds them together).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Mapping, Optional, Union


@dataclass(frozen=True)
class SkySettings:
    """``infra.kind=sky``: a SkyPilot cloud (AWS, Lambda, RunPod, ...) or a Slurm cluster."""

    name: str = "local"
    """``infra.name``: the infra's label (run tags, cost reports, the tracking refusal's message)."""

    provider: Optional[str] = None
    """``infra.provider``: SkyPilot's cloud name (``aws``, ``lambda``, ``runpod``, ``slurm``, ...);
    checked against SkyPilot's registry (``rules.check``)."""

    nodes: int = 1
    """``infra.nodes``: nodes of the job (SkyPilot's ``num_nodes``); torchrun spans them."""

    nproc_per_node: int = 0
    """``infra.nproc_per_node``: processes per node; 0: one per accelerator, else (CPU nodes) the
    mesh size split over the nodes."""

    accelerators: Optional[str] = None
    """``infra.accelerators``: per node, ``NAME:COUNT`` (``H100:8``) in the user's names; None: CPU
    nodes. Checked against the provider's catalog where it has an offline one."""

    accelerator_aliases: Mapping[str, str] = field(default_factory=dict)
    """``infra.accelerator_aliases``: the user's accelerator name -> the provider's catalog name
    (RunPod: ``H100`` -> ``H100-SXM``); provider data, set in conf/infra."""

    use_spot: bool = False
    """``infra.use_spot``: spot/preemptible instances (refused where SkyPilot declares none)."""

    region: Optional[str] = None
    """``infra.region``: the cloud region; None: any. Slurm: the cluster, i.e. its ``Host`` alias in
    ``~/.slurm/config`` (None: the only/first cluster there)."""

    zone: Optional[str] = None
    """``infra.zone``: a zone of ``region`` (needs ``region``). Slurm: the partition (None: the
    cluster's default partition)."""

    cpus: Optional[str] = None
    """``infra.cpus``: vCPUs per node in SkyPilot's syntax (``"8"``, ``"8+"``); also how many cores
    ``plan`` assumes a CPU node has (8 when unset)."""

    memory: Optional[str] = None
    """``infra.memory``: GB per node in SkyPilot's syntax (``"32+"``)."""

    disk_size: Optional[int] = None
    """``infra.disk_size``: node disk, GB; None: SkyPilot's default."""

    autostop_minutes: Optional[int] = None
    """``infra.autostop_minutes``: idle minutes before SkyPilot stops the cluster; None: no autostop
    (refused when set where SkyPilot has none, e.g. Slurm)."""

    down: bool = True
    """``infra.down``: tear the cluster down when the run ends (and on autostop); false keeps it
    for ``llmctl logs``/``down``. Slurm: release the allocation."""

    managed: bool = False
    """``infra.managed``: a SkyPilot managed job (recovered after preemption) instead of a cluster."""

    bucket: Optional[str] = None
    """``infra.bucket``: ``s3://...``/``gs://...`` where checkpoints outlive the nodes
    (``<bucket>/<run-id>``), unless ``checkpoint.dir`` is set."""

    mount_bucket: bool = True
    """``infra.mount_bucket``: the bucket as a SkyPilot storage mount at ``/llmctl-ckpt`` (true), or
    an fsspec URL the workload writes to itself (false: RunPod, Slurm's shared filesystems)."""

    node_python: Optional[str] = None
    """``infra.node_python``: a Python on the nodes (a shared filesystem) that already has llmctl's
    dependencies; the node install is skipped."""

    pip_args: str = ""
    """``infra.pip_args``: extra arguments for the node install (``--find-links ...``, a torch pin)."""

    candidates: list[Mapping[str, Any]] = field(default_factory=list)
    """``infra.candidates``: the providers this run may land on, each written out by composing
    (``llmctl.config.candidates``); empty: the one provider above."""

    pick: str = "ordered"
    """``infra.pick``: ``ordered`` (SkyPilot's ``resources.ordered``: the first with capacity) or
    ``cheapest`` (``resources.any_of``: its optimizer's cheapest)."""

    def options(self) -> list["SkySettings"]:
        """One settings per candidate (the job's keys with the candidate's resources), or this one."""
        if not self.candidates:
            return [self]
        own = {f.name for f in fields(self)}
        return [replace(self, candidates=[], **{k: v for k, v in c.items() if k in own}) for c in self.candidates]

    @classmethod
    def from_infra(cls, infra: Mapping[str, Any]) -> "SkySettings":
        """The settings from a resolved ``infra`` section (a plain dict); keys it lacks take the
        defaults, keys only other backends or llmctl itself read (``kind``, ``price_per_gpu_hour``)
        are left out."""
        values = {f.name: infra[f.name] for f in fields(cls) if f.name in infra}
        values["candidates"] = [dict(c) for c in values.get("candidates") or []]
        if values.get("accelerator_aliases") is None:
            values.pop("accelerator_aliases", None)
        else:
            values["accelerator_aliases"] = dict(values["accelerator_aliases"])
        return cls(**values)

    @classmethod
    def from_cfg(cls, cfg: Mapping[str, Any]) -> "SkySettings":
        """The settings from a resolved config's ``infra`` section."""
        return cls.from_infra(cfg["infra"])

    @classmethod
    def of(cls, infra: Union["SkySettings", Mapping[str, Any]]) -> "SkySettings":
        """``infra`` itself when already typed, else built from the ``infra`` section it is."""
        if isinstance(infra, SkySettings):
            return infra
        return cls.from_infra(infra)
