"""SkyPilot backend: clouds (AWS, Lambda, RunPod, ...) and Slurm, as clusters or managed jobs.

``SkyBackend`` implements ``llmctl.backends.Backend``: ``preflight`` checks credentials before any
MLflow run exists; ``status``/``logs``/``down`` work from the run alone. What it reads of ``infra``
is ``SkySettings`` (``settings.py``), built once by ``plan`` and carried on the ``SkyPlan``. The task
is built by ``sky_task`` (pure) and checked by ``sky_rules`` (SkyPilot's declared capabilities and
offline catalog). ``sky`` is imported inside functions only. Tags on the MLflow run
(``llmctl.sky.*``) say where the run lives, so ``status``/``logs``/``down`` need nothing but the
run id.

Cancels and teardowns are graceful (SkyPilot 0.14's ``graceful=True``): SkyPilot stops the task, then
waits for ``MOUNT_CACHED`` uploads to finish, so the newest checkpoint written to a cached bucket mount
reaches the bucket before the cluster goes (budget stops, ``llmctl down``, Ctrl-C, the end of a job).
"""

from __future__ import annotations

import copy
import enum
import io
import sys
from dataclasses import dataclass, replace
from typing import Any, Optional

from llmctl.backends.base import ENDED, JobStatus, log_name
from llmctl.backends.sky import rules as sky_rules
from llmctl.backends.sky import task as sky_task
from llmctl.backends.sky.facts import remembered
from llmctl.backends.sky.settings import SkySettings
from llmctl.config.candidates import label as candidate_label
from llmctl.config.compose import Composed, to_yaml
from llmctl.config.launcher_checks import resolve_layout
from llmctl.controller.procs import stop_controller
from llmctl.controller.workdir import run_dir
from llmctl.distribution.wheel import wheel_for_nodes
from llmctl.errors import ConfigError, LaunchError
from llmctl.plan.candidates import Candidate
from llmctl.plan.devices import Hardware
from llmctl.plan.job_plan import Plan
from llmctl.tracking.mlflow_run import RunHandle, client, redact, resolve_uri
from workloads.protocol.config import with_values

TAG_CLUSTER = "llmctl.sky.cluster"
TAG_JOB = "llmctl.sky.job_id"
TAG_MANAGED = "llmctl.sky.managed_job_id"
TAG_SCORE_JOB = "llmctl.sky.eval_job_id"  # the newest ``llmctl eval --tasks`` job on the run's cluster
STOP_WAIT_S = 120.0  # how long ``down`` waits for a live controller to cancel, tear down and close
# A run's managed job is top-level: SkyPilot 0.14 attaches a job launched from inside a job group
# (a sweep supervisor running as a managed job, say) to that group by default, which would cancel
# it with the group and show it under another job. ``None`` is SkyPilot's "never attach".
MANAGED_JOB_GROUP = None
TERMINAL_OK = {"SUCCEEDED"}
TERMINAL_BAD = {
    "FAILED",
    "FAILED_SETUP",
    "FAILED_DRIVER",
    "FAILED_PRECHECKS",
    "FAILED_NO_RESOURCE",
    "FAILED_CONTROLLER",
    "CANCELLED",
}


@dataclass
class SkyPlan(Plan):
    """A plan plus the SkyPilot task YAML and the catalog offers that ``llmctl plan`` prints, and
    the typed ``infra`` settings it was made from."""

    task_yaml: str = ""
    offers_text: str = ""
    settings: Optional[SkySettings] = None

    def describe(self) -> str:
        return "\n".join(
            [
                super().describe(),
                "",
                "# SkyPilot task (what `llmctl launch` submits; <run-id> is filled in then)",
                self.task_yaml.rstrip(),
                "",
                "# offers, cheapest first (SkyPilot catalog, on-demand unless infra.use_spot)",
                self.offers_text,
            ]
        )


def _int_prefix(value: Any) -> int:
    digits = "".join(ch for ch in str(value or "") if ch.isdigit())
    return int(digits) if digits else 0


def _hardware(settings: SkySettings) -> Hardware:
    """What one node of ``settings`` has: its accelerators, or CPUs (8 assumed when unsaid)."""
    acc = sky_task.node_accelerators(settings)
    if acc:
        return Hardware(f"{acc[0]}:{acc[1]}", acc[0], int(acc[1]), int(settings.nodes))
    return Hardware("cpu", None, 0, int(settings.nodes), _int_prefix(settings.cpus) or 8)


def _offers(settings: SkySettings) -> dict[bool, list[sky_rules.Offer]]:
    """Catalog offers in both modes (the estimate lists them), where SkyPilot says the provider sells spot."""
    modes = [False] + ([True] if sky_rules.capabilities(str(settings.provider)).supports("SPOT_INSTANCE") else [])
    return {spot: sky_rules.offers(replace(settings, use_spot=spot)) for spot in modes}


def _candidates(cfg: dict[str, Any], infra: SkySettings) -> list[Candidate]:
    """Each of ``infra.candidates`` checked as its own infra would be (one line naming it when it
    cannot run the job), with its hardware and offers; none without candidates."""
    if not infra.candidates:
        sky_rules.check(cfg, infra)
        return []
    out, options = [], infra.options()
    for i, (written, option) in enumerate(zip(infra.candidates, options)):
        try:
            sky_rules.check(cfg, option)
        except ConfigError as exc:
            raise ConfigError(f"infra.candidates[{i}] ({candidate_label(written)}): {exc}") from None
        out.append(Candidate(i, dict(written), _hardware(option), _offers(option), sky_task.infra_string(option)))
    sizes = {sky_task.nproc_per_node(cfg, o) for o in options}
    if len(sizes) > 1:
        raise ConfigError(
            "Bad value for 'infra.candidates': they give different numbers of processes per node"
            f" ({', '.join(c.label for c in out)}), and the job's layout and memory plan are sized for one."
            " Fix: the same accelerator count on every candidate"
        )
    return out


def _first_tried(infra: SkySettings, cands: list[Candidate]) -> int:
    """Which candidate SkyPilot takes first: the first listed (``ordered``), or its optimizer's cheapest
    per hour (``any_of``; a provider without a catalog, Slurm or Kubernetes, costs SkyPilot $0)."""
    if infra.pick == "ordered":
        return 0
    return min(range(len(cands)), key=lambda i: (cands[i].hourly or 0.0, i))


def _offers_text(infra: dict[str, Any], cands: list[Candidate], found: list[sky_rules.Offer]) -> str:
    """The offers ``plan`` lists: the provider's, or each candidate's under its name."""
    if not cands:
        return sky_rules.format_offers(found, infra)
    parts = []
    for c in cands:
        own = c.offers.get(bool(c.infra.get("use_spot")), [])
        parts.append(f"candidate {c.index} ({c.label}):\n{sky_rules.format_offers(own, {**infra, **c.infra})}")
    return "\n".join(parts)


def cluster_name(run_id: str) -> str:
    return f"llmctl-{run_id[:10]}"


@remembered
def task_yaml(config: dict[str, Any]) -> str:
    """The task through SkyPilot's own loader and back, credentials redacted."""
    import yaml
    from sky import task as sky_task_mod

    out = sky_task_mod.Task.from_yaml_config(copy.deepcopy(config)).to_yaml_config()
    sky_task_mod.redact_task_yaml_dict(out)
    out = {k: v for k, v in out.items() if not k.startswith("_") and v not in ({}, None)}

    class _Dumper(yaml.SafeDumper):
        pass

    def _str(dumper: Any, value: str) -> Any:  # scripts as readable block literals
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)

    _Dumper.add_representer(str, _str)
    return yaml.dump(out, Dumper=_Dumper, sort_keys=False, default_flow_style=False)


class _Tee(io.TextIOBase):
    """SkyPilot's log stream to the terminal and to ``llmctl-runs/<id>/output.log``."""

    def __init__(self, *streams: Any) -> None:
        self.streams = streams

    def write(self, text: str) -> int:
        for s in self.streams:
            s.write(text)
            s.flush()
        return len(text)

    def writable(self) -> bool:
        return True


def _field(record: Any, key: str) -> Any:
    """A field of a SkyPilot job record (a dict or an object); SkyPilot's status enums as their names."""
    value = record.get(key) if isinstance(record, dict) else getattr(record, key, None)
    return value.value if isinstance(value, enum.Enum) else value


def _settings(plan: Plan) -> SkySettings:
    """The settings ``plan`` built (a plan made elsewhere: from its config's ``infra``)."""
    settings = getattr(plan, "settings", None)
    return settings if isinstance(settings, SkySettings) else SkySettings.from_cfg(plan.cfg)


def _launch_cluster(task: Any, infra: SkySettings, handle: RunHandle, mc: Any, out: Any, job_tag: str = TAG_JOB) -> int:
    import sky

    cluster = cluster_name(handle.run_id)
    mc.set_tag(handle.run_id, TAG_CLUSTER, cluster)
    autostop = infra.autostop_minutes  # None where SkyPilot has no autostop (sky_rules.check)
    job_id = None
    try:
        try:
            job_id, _ = sky.stream_and_get(
                sky.launch(
                    task,
                    cluster_name=cluster,
                    idle_minutes_to_autostop=autostop,
                    down=bool(infra.down) and autostop is not None,
                ),
                output_stream=out,
            )
        except Exception as exc:
            _down_quietly(cluster)
            raise LaunchError(f"SkyPilot could not launch {cluster}: {' '.join(str(exc).split())[:2000]}") from None
        mc.set_tag(handle.run_id, job_tag, str(job_id))
        sky.tail_logs(cluster, job_id, follow=True, output_stream=out)
        statuses = sky.get(sky.job_status(cluster, [job_id]))
        status = _field({"s": statuses.get(job_id) or statuses.get(str(job_id))}, "s")
        out.write(f"llmctl: job {job_id} on {cluster}: {status}\n")
        return 0 if status in TERMINAL_OK else 1
    except BaseException:  # a stop request, or SkyPilot failing mid-run: the job must not run on unwatched
        if job_id is not None:
            _quietly(lambda: sky.get(sky.cancel(cluster, job_ids=[job_id])))
        raise
    finally:
        if infra.down:
            _down_quietly(cluster)


def _launch_managed(task: Any, handle: RunHandle, mc: Any, out: Any) -> int:
    import sky

    name = cluster_name(handle.run_id)
    try:
        job_ids, _ = sky.stream_and_get(
            sky.jobs.launch(task, name=name, job_group=MANAGED_JOB_GROUP), output_stream=out
        )
    except Exception as exc:
        raise LaunchError(
            f"SkyPilot could not submit managed job {name}: {' '.join(str(exc).split())[:2000]}"
        ) from None
    job_id = job_ids[0] if isinstance(job_ids, list) else job_ids
    mc.set_tag(handle.run_id, TAG_MANAGED, str(job_id))
    try:
        sky.jobs.tail_logs(job_id=job_id, follow=True, output_stream=out)
        status = _managed_status(job_id)
    except BaseException:  # a stop request, or the API server failing mid-tail: cancel, so the run's
        # FAILED/KILLED is true (a job left running would bill on while its run says it ended)
        _quietly(lambda: sky.get(sky.jobs.cancel(job_ids=[job_id], graceful=True)))
        raise
    out.write(f"llmctl: managed job {job_id}: {status}\n")
    return 0 if status in TERMINAL_OK else 1


def _managed_record(job_id: int) -> Any:
    import sky

    result = sky.get(sky.jobs.queue_v2(refresh=False, job_ids=[int(job_id)]))
    records = result[0] if isinstance(result, tuple) else result
    for rec in records or []:
        if str(_field(rec, "job_id")) == str(job_id):
            return rec
    return None


def _managed_status(job_id: int) -> Optional[str]:
    rec = _managed_record(job_id)
    return _field(rec, "status") if rec is not None else None


def _end_at(rec: Any) -> Optional[float]:
    """When SkyPilot says a job ended (epoch seconds), or None."""
    value = _field(rec, "end_at") if rec is not None else None
    try:
        return float(value) if value else None
    except (TypeError, ValueError):
        return None


def _last_output(run_id: str) -> Optional[float]:
    """When the controller last wrote the job's output (its copy in the run's folder), or None."""
    try:
        return (run_dir(run_id) / "output.log").stat().st_mtime
    except OSError:
        return None


def _quietly(fn: Any) -> None:
    try:
        fn()
    except Exception:
        pass


def _down_quietly(cluster: str) -> None:
    import sky

    _quietly(lambda: sky.get(sky.down(cluster, graceful=True)))


def _cluster_status(cluster: str) -> Optional[str]:
    import sky

    records = sky.get(sky.status(cluster_names=[cluster]))
    return _field(records[0], "status") if records else None


def _job_status(cluster: str, job_id: str) -> Optional[str]:
    import sky

    statuses = sky.get(sky.job_status(cluster, [int(job_id)]))
    return _field({"s": statuses.get(int(job_id), statuses.get(job_id))}, "s")


def _job_end_at(cluster: str, job_id: str) -> Optional[float]:
    """The job's end time from the cluster's job queue (best-effort: None when it cannot be read)."""
    import sky

    try:
        for rec in sky.get(sky.queue(cluster)) or []:
            if str(_field(rec, "job_id")) == str(job_id):
                return _end_at(rec)
    except Exception:
        return None
    return None


def cluster_kept(run: Any) -> bool:
    """Whether the run's cluster is still up (``infra.down=false``): what its nodes wrote to their own
    disks is still there. A managed job's cluster is its controller's and gone with the job."""
    cluster = run.data.tags.get(TAG_CLUSTER)
    return bool(cluster) and _cluster_status(cluster) is not None


class SkyBackend:
    """SkyPilot clusters and managed jobs; ``llmctl.sky.*`` tags on the run say where it lives."""

    name = "sky"

    def plan(self, composed: Composed) -> SkyPlan:
        cfg = composed.cfg
        infra = SkySettings.from_cfg(cfg)  # the one typed view of cfg["infra"] this plan reads
        uri = resolve_uri(cfg["tracking"]["uri"])
        cands = _candidates(cfg, infra)
        # the one SkyPilot tries first: its hardware, offers, memory plan and estimate are the plan's own
        first_index = _first_tried(infra, cands) if cands else 0
        first = infra.options()[first_index] if cands else infra
        nproc = sky_task.nproc_per_node(cfg, first)
        layout = resolve_layout(composed.typed, infra.nodes * nproc)
        ckpt = sky_task.checkpoint_dir(cfg, sky_task.RUN_ID_PLACEHOLDER, infra)
        resolved = {**cfg, "parallel": {**cfg["parallel"], **layout}, "checkpoint": {**cfg["checkpoint"], "dir": ckpt}}
        acc = sky_task.node_accelerators(first)
        device = f"{acc[1]}x {acc[0]} per node, nccl" if acc else "CPU, gloo"
        config = sky_task.task_config(
            resolved,
            run_id=sky_task.RUN_ID_PLACEHOLDER,
            tracking_uri=uri,
            experiment_id="<experiment-id>",
            local_config="<run-dir>/config.yaml",
            settings=infra,
        )
        offers = _offers(first)
        found = offers.get(bool(first.use_spot), [])
        mode = "managed job" if infra.managed else "cluster"
        where = f"{sky_task.infra_string(first)} via SkyPilot ({mode}{', spot' if first.use_spot else ''})"
        notes = []
        if cands:
            where += f", the first of {len(cands)} candidates (infra.pick={infra.pick})"
        elif found:
            best = found[0]
            notes.append(
                f"cheapest offer: {best.instance_type} in {best.region}, ${best.total_hour:.2f}/h"
                f" for {infra.nodes} node(s)"
            )
        if str(resolved["checkpoint"]["dir"]).startswith("llmctl-runs/"):
            notes.append(
                "checkpoints stay on the nodes and vanish with them; " + sky_rules.keep_checkpoints(first.provider)
            )
        if infra.managed and str(resolved["checkpoint"]["dir"]).startswith("llmctl-runs/"):
            notes.append("a managed job restarts from scratch after a preemption unless checkpoints go to a bucket")
        return SkyPlan(
            cfg=resolved,
            choices=composed.choices,
            backend=self.name,
            where=where,
            nodes=infra.nodes,
            nproc_per_node=nproc,
            layout=layout,
            device=device,
            command=["bash", "-c", "<run script below>"],
            tracking_uri=uri,
            hardware=_hardware(first),
            offers=offers,
            notes=notes,
            task_yaml=task_yaml(config),
            refusals=[r for r in [sky_rules.tracking_refusal(infra.name, uri)] if r],
            offers_text=_offers_text(resolved["infra"], cands, found),
            settings=infra,
            typed=with_values(with_values(composed.typed, "parallel", **layout), "checkpoint", dir=ckpt),
            candidates=cands,
            first_candidate=first_index,
            pick=infra.pick,
        )

    def preflight(self, plan: Plan) -> None:
        """A store the nodes can reach, and credentials as ``sky check`` sees them, before an MLflow
        run or a cluster is created."""
        infra = _settings(plan)
        refusal = sky_rules.tracking_refusal(infra.name, plan.tracking_uri)
        if refusal:
            raise ConfigError(refusal)
        for provider in dict.fromkeys(str(o.provider) for o in infra.options()):  # each candidate's
            sky_rules.check_credentials(provider)

    def finalize(self, plan: Plan, handle: RunHandle) -> dict[str, Any]:
        """Fill in what needs the run id: where checkpoints go."""
        ckpt = str(plan.cfg["checkpoint"]["dir"]).replace(sky_task.RUN_ID_PLACEHOLDER, handle.run_id)
        plan.set_values("checkpoint", dir=ckpt)
        return plan.cfg

    def launch(self, plan: Plan, handle: RunHandle, echo: Optional[Any] = None) -> int:
        """Submit the task; follow its logs; return 0 if the job succeeded. Nothing is left idling.

        A ``score`` job (``llmctl eval RUN --tasks`` on the run's infra) runs on the run's cluster
        (reused while it is up) as a cluster job, whatever ``infra.managed`` says: its output goes to
        ``score.log``, its job id to ``TAG_SCORE_JOB``, the training job's tags stay as they are."""
        import sky

        cfg, infra = plan.cfg, _settings(plan)
        rdir = run_dir(handle.run_id)
        rdir.mkdir(parents=True, exist_ok=True)
        name = "config.yaml" if plan.job == "train" else f"{plan.job}-config.yaml"
        (rdir / name).write_text(to_yaml(sky_task.node_config(cfg, handle.run_id)))
        config = sky_task.task_config(
            cfg,
            run_id=handle.run_id,
            tracking_uri=handle.uri,
            experiment_id=handle.experiment_id,
            local_config=str(rdir / name),
            wheel=str(wheel_for_nodes()),
            attempt_env=handle.attempt_env,
            settings=infra,
            job=plan.job,
            parallelize=plan.parallelize,
        )
        task = sky.Task.from_yaml_config(config)
        mc = client(handle.uri)
        with open(rdir / log_name(plan.job), "a" if plan.job == "train" else "w") as log:
            out = _Tee(echo or sys.stdout, log)
            if plan.job == "score":
                return _launch_cluster(task, infra, handle, mc, out, TAG_SCORE_JOB)
            if infra.managed:
                return _launch_managed(task, handle, mc, out)
            return _launch_cluster(task, infra, handle, mc, out)

    def status(self, run: Any, uri: str) -> JobStatus:
        """Cluster and job state from SkyPilot; ``ended`` once the job reached a final state."""
        tags = run.data.tags
        lines, job_state, ended_at = [], None, None
        if tags.get(TAG_MANAGED):
            rec = _managed_record(int(tags[TAG_MANAGED]))
            job_state, ended_at = (_field(rec, "status"), _end_at(rec)) if rec is not None else (None, None)
            lines.append(f"managed job: {tags[TAG_MANAGED]} {job_state or 'unknown'}")
        elif tags.get(TAG_CLUSTER):
            cluster = tags[TAG_CLUSTER]
            state = _cluster_status(cluster)
            lines.append(f"cluster:     {cluster} {state or 'gone (down)'}")
            if state and tags.get(TAG_JOB):
                job_state = _job_status(cluster, tags[TAG_JOB])
                lines.append(f"job:         {tags[TAG_JOB]} {job_state or 'unknown'}")
                if job_state in TERMINAL_OK | TERMINAL_BAD:
                    ended_at = _job_end_at(cluster, tags[TAG_JOB])
            elif state is None and run.info.status == "RUNNING":
                # the cluster is gone (reclaimed, torn down) and its job with it: the job has ended,
                # when its output last came (else the lifecycle's last sign of life, its metrics)
                return JobStatus(lines, "ended: its cluster is gone", False, _last_output(run.info.run_id))
        else:
            lines.append("cluster:     none recorded (the launch stopped before SkyPilot was called)")
        ended = job_state if job_state in TERMINAL_OK | TERMINAL_BAD else None
        return JobStatus(lines, ended, job_state in TERMINAL_OK, ended_at)

    def alive(self, run: Any, uri: str) -> bool:
        """A RUNNING run may have a job on its nodes (asking SkyPilot would start its API server)."""
        return run.info.status == "RUNNING"

    def logs(self, run: Any, uri: str, follow: bool) -> int:
        """The job's output from SkyPilot; the controller's copy once the cluster is gone."""
        import sky

        tags = run.data.tags
        if tags.get(TAG_MANAGED):
            sky.jobs.tail_logs(job_id=int(tags[TAG_MANAGED]), follow=follow)
            return 0
        cluster = tags.get(TAG_CLUSTER)
        if cluster and tags.get(TAG_JOB) and _cluster_status(cluster):
            sky.tail_logs(cluster, int(tags[TAG_JOB]), follow=follow)
            return 0
        copy = run_dir(run.info.run_id) / "output.log"
        if copy.is_file():
            sys.stdout.write(copy.read_text())
            return 0
        raise LaunchError(
            f"no logs for run {run.info.run_id}: cluster {cluster or '-'} is gone and {copy} does not exist"
        )

    def down(self, run: Any, uri: str, force: bool = False) -> str:
        """Tear the cluster down (or cancel the managed job): SkyPilot's stop is already final."""
        import sky

        tags = run.data.tags
        if run.info.status not in ENDED:
            # a live controller here stops its job (cancel, teardown) and closes the run itself; a
            # cancel from here would race it, and it would close the run FAILED (one closer per run)
            still = stop_controller(run.info.run_id, STOP_WAIT_S)
            if still is not None:
                return f"run {run.info.run_id}: its controller (pid {still}) is still stopping it"
        if tags.get(TAG_MANAGED):
            sky.get(sky.jobs.cancel(job_ids=[int(tags[TAG_MANAGED])], graceful=True))
            what = f"managed job {tags[TAG_MANAGED]} cancelled"
        elif tags.get(TAG_CLUSTER):
            cluster = tags[TAG_CLUSTER]
            if _cluster_status(cluster) is None:
                what = f"cluster {cluster} was already down"
            else:
                sky.get(sky.down(cluster, graceful=True))
                what = f"cluster {cluster} is down"
        else:
            raise ConfigError(f"run {run.info.run_id} has no SkyPilot cluster or job recorded")
        return redact(what)
