"""``llmctl eval`` / ``llmctl export`` on the controller side: find the config, run, log.

The target is a run id (its resolved ``config.yaml`` artifact says where the checkpoints are and
how the model and data were built), a checkpoint's MLflow model URI (``models:/m-...``: its run, at
its step; ``checkpoint_models``) or a checkpoint URL (a root or a ``step-N`` directory; the
config is the ``config.yaml`` beside it, as ``llmctl-runs/<id>/`` has, or else composed from the
overrides as ``launch`` would). The work runs here under torchrun
(``python -m workloads.pretrain.evaluate``, any number of processes) and writes one JSON result;
llmctl logs it into the run (same run, not a child: eval metrics sit beside training's, at the
checkpoint's step):

    eval/val_loss, eval/perplexity, eval/bits_per_byte   held-out split (training's val batches)
    eval/source/...                                      ``data.source=...`` (another data set)
    eval/hf/...                                          ``--hf DIR`` (the export, via transformers)
    eval/<task>/<metric>                                 ``--tasks`` (lm-evaluation-harness: benchmark_scores)
    artifact eval/step-<N>/samples.json                  metrics, samples, what was evaluated

torch, mlflow and omegaconf are imported inside functions (``llmctl --help`` stays fast).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from llmctl.errors import ConfigError, LaunchError
from llmctl.tracking.logged_models import URI_PREFIX
from llmctl.tracking.logged_models import resolve as resolve_model
from workloads.planner.hardware import cpu_threads
from workloads.protocol.run_contract import EXPORT_DTYPES, EXPORT_INFO

# ``data.*`` overrides of an existing run would change how its tokenizer was built; for eval they
# name the data set to score instead, tokenized with the run's own tokenizer.
DATA_TO_EVAL = {"data.source": "eval.source", "data.text_field": "eval.text_field"}


@dataclass
class Target:
    """What to evaluate: the config it was trained with, and the run to log into (if any)."""

    cfg: dict[str, Any]
    run_id: Optional[str]
    uri: str
    checkpoint: Optional[str]  # an explicit checkpoint URL; None: cfg's checkpoint.dir
    workdir: Path
    made: Optional[Path] = None  # the outermost directory making ``workdir`` created: a refusal removes it


def _make(workdir: Path) -> Optional[Path]:
    """``mkdir -p workdir``; returns the outermost directory that did not exist before (None: none)."""
    made = next((p for p in reversed([workdir, *workdir.parents]) if not p.exists()), None)
    workdir.mkdir(parents=True, exist_ok=True)
    return made


def discard(t: Optional[Target]) -> None:
    """A refused eval or export leaves no scratch directory behind (nor a run folder it created)."""
    if t is not None and t.made is not None:
        shutil.rmtree(t.made, ignore_errors=True)


def is_checkpoint_url(target: str) -> bool:
    if "://" in target or "/" in target or os.sep in target:
        return True
    try:
        return Path(target).exists()
    except OSError:  # a name no file can have (too long): a run id, or nothing
        return False


def _apply_overrides(cfg: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``key=value`` overrides of a resolved config, checked against the schema."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from llmctl.config import root_schema as schema
    from llmctl.config.compose import GROUPS, _did_you_mean, to_typed

    dotlist = []
    for raw in overrides:
        key, eq, value = raw.partition("=")
        if not eq or not key:
            raise ConfigError(f"'{raw}' is not an override: write key=value (e.g. eval.max_new_tokens=64)")
        key = key.lstrip("+")
        if key in GROUPS:
            raise ConfigError(
                f"'{raw}': a run's model and data are fixed by its checkpoint; "
                "set keys instead (e.g. eval.val_batches=8, data.source=...)"
            )
        if key not in schema.schema_keys():
            raise ConfigError(
                f"Unknown key '{key}' in '{raw}'.{_did_you_mean(key, schema.schema_keys())}"
                " Run 'llmctl config show' to see every key."
            )
        dotlist.append(f"{DATA_TO_EVAL.get(key, key)}={value}")
    try:
        typed = OmegaConf.merge(to_typed(schema.drop_retired(cfg)), OmegaConf.from_dotlist(dotlist))
        return OmegaConf.to_container(typed, resolve=True, enum_to_str=True)
    except (OmegaConfBaseException, ValueError) as exc:
        raise ConfigError(f"Bad override: {str(exc).splitlines()[0]}") from None


def _beside(url: str) -> Optional[Path]:
    """``config.yaml`` of the run a local checkpoint belongs to (``llmctl-runs/<id>/``)."""
    if "://" in url and not url.startswith("file://"):
        return None
    path = Path(url.removeprefix("file://")).expanduser().resolve()
    for parent in (path.parent, path.parent.parent):
        if (parent / "config.yaml").is_file():
            return parent / "config.yaml"
    return None


def resolve_target(
    target: str,
    overrides: list[str],
    tracking_uri: Optional[str],
    config_dir: Optional[str] = None,
    untrained: Optional[Callable[[Any, Any], Optional[str]]] = None,
) -> Target:
    """What ``target`` names: a run (by id or prefix), a logged model, or a checkpoint URL. ``untrained``
    (client, run) says why a run has nothing to score (the CLI passes the sweep stage's
    ``state.untrained``: a sweep's parent, a trial that never started), refused before anything is written."""
    from omegaconf import OmegaConf

    from llmctl.controller.workdir import RUNS_DIR, run_dir
    from llmctl.tracking import runs

    uri = runs.tracking_uri(tracking_uri)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if target.startswith(URI_PREFIX):  # a checkpoint logged as an MLflow model: its run, at its step
        from llmctl.tracking.mlflow_run import client, missing_store

        missing = missing_store(uri, f"no model {target}")
        if missing:
            raise ConfigError(f"{missing}. Fix: run llmctl where the run was launched, or pass --tracking-uri")
        target, step = resolve_model(client(uri), target)
        overrides = [f"eval.step={step}", *overrides]
    if not is_checkpoint_url(target):
        run = runs.get_run(target, uri)  # a full id or a unique prefix
        rid = run.info.run_id
        from llmctl.tracking.mlflow_run import client

        why = untrained(client(uri), run) if untrained else None  # e.g. a sweep's parent: named, not "no config"
        if why:
            raise ConfigError(why)
        tmp = run_dir(rid) / f"eval-{stamp}"
        made = _make(tmp)
        try:
            local = client(uri).download_artifacts(rid, "config.yaml", str(tmp))
        except Exception as exc:
            discard(Target({}, rid, uri, None, tmp, made))
            raise ConfigError(
                f"run {rid} has no config.yaml artifact ({type(exc).__name__}); was it started by llmctl launch?"
            ) from None
        cfg = OmegaConf.to_container(OmegaConf.load(local), resolve=True)
        return Target(_apply_overrides(cfg, overrides), run.info.run_id, uri, None, tmp, made)
    beside = _beside(target)
    if beside is not None:
        cfg = _apply_overrides(OmegaConf.to_container(OmegaConf.load(beside), resolve=True), overrides)
    else:  # a bare URL: the config comes from the overrides, as for launch
        from llmctl.config.compose import compose

        cfg = compose(overrides, config_dir).cfg
    workdir = Path.cwd() / RUNS_DIR / f"eval-{stamp}"
    return Target(cfg, None, uri, target, workdir, _make(workdir))


# ----------------------------------------------------------------------------- running


def _env(nproc: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_RUN")}
    env["PYTHONUNBUFFERED"] = "1"
    if nproc > 1:
        env.setdefault("OMP_NUM_THREADS", str(cpu_threads(nproc)))
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def check_checkpoint(t: Target) -> int:
    """The step to load is there and complete, before any worker starts: else exit 3 naming the
    steps that are (a step ``checkpoint.keep`` deleted, or one never saved, used to fail in the worker)."""
    from llmctl.tracking.mlflow_run import redact
    from workloads.protocol.checkpoint_layout import list_checkpoints, split_step_dir

    url = str(t.checkpoint or (t.cfg.get("checkpoint") or {}).get("dir") or "")
    if not url:
        raise ConfigError("the run has no checkpoint.dir: there is no checkpoint to load")
    root, named = split_step_dir(url)
    want = named if named is not None else (t.cfg.get("eval") or {}).get("step")
    try:
        found = list_checkpoints(root)
    except Exception as exc:
        raise ConfigError(f"cannot list checkpoints in {redact(root)}: {type(exc).__name__}: {exc}") from None
    complete = sorted(s for s, ok in found.items() if ok)
    if not complete:
        raise ConfigError(f"no complete checkpoint under {redact(root)}")
    if want is None:
        return complete[-1]
    if int(want) in complete:
        return int(want)
    ck = t.cfg.get("checkpoint") or {}
    every, keep = int(ck.get("every") or 0), int(ck.get("keep") or 0)
    if int(want) < complete[0] and (not every or int(want) % every == 0) and len(complete) >= keep > 0:
        why = f"it was deleted: checkpoint.keep={keep} keeps only the newest {keep}"
    elif found.get(int(want)) is False:
        why = "its write never completed (no .complete marker)"
    else:
        why = f"it was never saved (checkpoint.every={every}, and the last step)"
    listed = ", ".join(map(str, complete))
    raise ConfigError(
        f"no checkpoint at step {want} under {redact(root)}: {why}. Complete: {listed}."
        f" Fix: eval.step=<one of {listed}> (export: --step), or leave it out for the newest"
    )


def run_workload(t: Target, nproc: int, extra: list[str], echo: Callable[[str], None]) -> dict[str, Any]:
    """``torchrun -m workloads.pretrain.evaluate`` with ``t``'s config; returns its JSON result."""
    from llmctl.config.compose import to_yaml

    if "--hf" not in extra:  # scoring an export reads no checkpoint
        check_checkpoint(t)

    config_path, out_path = t.workdir / "config.yaml", t.workdir / "result.json"
    config_path.write_text(to_yaml(t.cfg))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes=1",
        f"--nproc_per_node={nproc}",
        "-m",
        "workloads.pretrain.evaluate",
        "--config",
        str(config_path),
        "--out",
        str(out_path),
    ]
    if t.checkpoint:
        cmd += ["--checkpoint", t.checkpoint]
    cmd += extra
    with open(t.workdir / "output.log", "w") as log:
        proc = subprocess.Popen(
            cmd,
            env=_env(nproc),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=True,
        )
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                echo(line.rstrip("\n"))
            code = proc.wait()
        except KeyboardInterrupt:
            os.killpg(proc.pid, 2)
            proc.wait(timeout=30)
            raise
    if code != 0 or not out_path.is_file():
        raise LaunchError(f"eval workload exited with code {code} (log: {t.workdir / 'output.log'})")
    return json.loads(out_path.read_text())


# ----------------------------------------------------------------------------- logging


def metric_prefix(cfg: dict[str, Any], hf: bool) -> str:
    if hf:
        return "eval/hf/"
    return "eval/source/" if cfg["eval"].get("source") else "eval/"


def log_result(t: Target, result: dict[str, Any], prefix: str) -> None:
    """Metrics at the checkpoint's step, and the whole result as ``eval/step-N/samples.json``."""
    if not t.run_id:
        return
    from mlflow.entities import Metric

    from llmctl.tracking.mlflow_run import client

    mc = client(t.uri)
    step = int(result.get("step") or 0)
    ts = int(time.time() * 1000)
    m = result["metrics"]
    metrics = [Metric(f"{prefix}{k}", float(m[k]), ts, step) for k in ("val_loss", "perplexity", "bits_per_byte")]
    mc.log_batch(t.run_id, metrics=metrics)
    name = "samples.json" if prefix == "eval/" else f"{prefix.strip('/').replace('/', '-')}.json"
    mc.log_dict(
        t.run_id,
        {**result, "config": {"eval": t.cfg["eval"], "train.val_batches": t.cfg["train"]["val_batches"]}},
        f"eval/step-{step}/{name}",
    )
    mc.set_tag(t.run_id, "llmctl.eval.last_step", str(step))


def check_export_dtype(dtype: str) -> None:
    if dtype not in EXPORT_DTYPES:
        raise ConfigError(f"--dtype {dtype}: an export is written in {', '.join(EXPORT_DTYPES)}. Fix: --dtype bf16")


def export_hf(
    t: Target, out: Optional[str], echo: Callable[[str], None], dtype: str = EXPORT_DTYPES[0], tag: bool = True
) -> tuple[Path, int]:
    """Write the checkpoint as a transformers Llama model (weights in ``dtype``: bf16, fp16 or
    fp32); tag the run with where it is (not a scratch export ``--tasks`` scores and deletes)."""
    check_export_dtype(dtype)
    out_dir = Path(out).expanduser().resolve() if out else t.workdir.parent / "export-hf"
    args = ["--export-hf", str(out_dir), "--export-dtype", dtype] + (["--run-id", t.run_id] if t.run_id else [])
    result = run_workload(t, 1, args, echo)
    step = int(result["step"])
    if t.run_id and tag:
        from llmctl.tracking.mlflow_run import client

        mc = client(t.uri)
        mc.set_tag(t.run_id, "llmctl.export.hf", str(out_dir))
        mc.set_tag(t.run_id, "llmctl.export.hf_step", str(step))
    return out_dir, step


def check_peft(t: Target) -> None:
    """``--format peft`` needs adapters: a run without LoRA is refused before any worker starts."""
    lora = ((t.cfg.get("model") or {}).get("lora") or {}).get("rank") or 0
    if not int(lora):
        raise ConfigError(
            "--format peft exports LoRA adapters, but this run trained every weight (model.lora.rank=0)."
            " Fix: --format hf"
        )


def export_peft(t: Target, out: Optional[str], echo: Callable[[str], None]) -> tuple[Path, int]:
    """Write a LoRA run's adapters as PEFT does (``adapter_config.json`` + ``adapter_model.safetensors``);
    tag the run with where they are."""
    check_peft(t)
    out_dir = Path(out).expanduser().resolve() if out else t.workdir.parent / "export-peft"
    args = ["--export-peft", str(out_dir)] + (["--run-id", t.run_id] if t.run_id else [])
    result = run_workload(t, 1, args, echo)
    step = int(result["step"])
    if t.run_id:
        from llmctl.tracking.mlflow_run import client

        mc = client(t.uri)
        mc.set_tag(t.run_id, "llmctl.export.peft", str(out_dir))
        mc.set_tag(t.run_id, "llmctl.export.peft_step", str(step))
    return out_dir, step


def upload_export(t: Target, out_dir: Path, fmt: str = "hf") -> None:
    if t.run_id:
        from llmctl.tracking.mlflow_run import client

        client(t.uri).log_artifacts(t.run_id, str(out_dir), f"export/{fmt}")


def export_step(hf_dir: str) -> Optional[int]:
    info = Path(hf_dir) / EXPORT_INFO
    return json.loads(info.read_text())["step"] if info.is_file() else None


# ----------------------------------------------------------------------------- transformers


def require_transformers() -> None:
    """``--hf`` and ``--tasks`` load the export with transformers: say how to get it before any work."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ConfigError(
            "scoring a Hugging Face export needs transformers: pip install 'llmctl-train[hf]'"
            " (llmctl export itself does not)"
        ) from None
