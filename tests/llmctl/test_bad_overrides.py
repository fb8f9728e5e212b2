"""Every malformed override: exit 3, one line naming the key and the fix, no traceback, no run."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import run_cli

# (override, text the message must contain: the key, and the fix or the options)
BAD = [
    ("train.lrr=1e-3", ["train.lrr", "Did you mean 'train.lr'"]),
    ("trainsteps=10", ["trainsteps", "Did you mean 'train.steps'"]),
    ("train.steps=abc", ["train.steps", "integer"]),
    ("train.lr=", ["train.lr", "number"]),
    ("model=large", ["model 'large'", "tiny", "smoke", "1b", "8b"]),
    ("infra=nowhere", ["infra 'nowhere'", "local"]),
    ("+train.new_key=1", ["train.new_key", "refused"]),
    ("+model.dim=3", ["model.dim", "without '+'"]),
    ("train.steps=-5", ["train.steps", "positive"]),
    ("model.kernels=cuda", ["model.kernels", "reference|fused"]),
    ("parallel.tp=3", ["parallel.tp", "divide"]),
    ("train.batch_size=0", ["train.batch_size", "positive"]),
    ("parallel.collective_timeout_s=0", ["parallel.collective_timeout_s", "> 0 seconds", "Fix"]),
    ("train.seq_len=100000", ["train.seq_len", "max_seq_len"]),
    ("model.tie_embeddings=maybe", ["model.tie_embeddings", "true|false"]),
    ("checkpoint.every=soon", ["checkpoint.every", "integer"]),
    ("train.lr=1e-3,3e-4", ["train.lr", "-m"]),
    ("data=files", ["data.source", "Fix"]),
    ("=5", ["'=5'", "key=value"]),
    ("~model", ["model", "cannot be removed"]),
    ("hydra.run.dir=/tmp", ["hydra"]),
    ("train.fp8=fp4", ["train.fp8", "none|tensorwise|rowwise"]),
    # train.dtype=auto would be bf16 on a GPU, but this machine has none
    ("train.fp8=rowwise", ["train.fp8", "targets CPU", "Fix: train.fp8=none"]),
    ("model.loss_kernel=liger", ["model.loss_kernel", "CUDA only", "Fix: model.loss_kernel=chunked"]),
    # infra=local refuses what only the SkyPilot backend reads rather than ignore it
    ("infra.bucket=s3://ckpts/x", ["infra.bucket", "infra.kind=local does not read it", "Fix: infra.bucket=null"]),
    ("infra.nodes=2", ["infra.nodes", "one node", "Fix: infra.nodes=1"]),
]


@pytest.mark.parametrize("override,needles", BAD, ids=[b[0] for b in BAD])
def test_bad_override_is_refused_clearly(
    override: str, needles: list[str], cli_env: dict[str, str], tmp_path: Path
) -> None:
    out = run_cli(["launch", "model=tiny", override], tmp_path, cli_env)
    assert out.returncode == 3, (out.stdout, out.stderr)
    assert "Traceback" not in out.stderr + out.stdout
    message = out.stderr.strip()
    assert message.startswith("error: ") and len(message.splitlines()) == 1, message
    for needle in needles:
        assert needle in message, message
    # nothing was created: no tracking store (so no run left RUNNING), no run directory
    assert not (tmp_path / "mlflow.db").exists()
    assert not (tmp_path / "llmctl-runs").exists()


# ``model.init_from`` names a directory with transformers' config.json: what a user gives instead
INIT_FROM = {
    "a-file": ("weights.safetensors", None, ["model.init_from", "no config.json at weights.safetensors/config.json"]),
    "not-json": ("ckpt", "{not json", ["model.init_from", "ckpt/config.json is not JSON", "line 1", "Fix: "]),
}


@pytest.mark.parametrize("case", INIT_FROM, ids=list(INIT_FROM))
def test_a_bad_init_from_is_refused_clearly(case: str, cli_env: dict[str, str], tmp_path: Path) -> None:
    name, config_json, needles = INIT_FROM[case]
    if config_json is None:
        (tmp_path / name).write_bytes(b"\0" * 16)
    else:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(config_json)
    out = run_cli(["launch", f"model.init_from={name}"], tmp_path, cli_env)
    message = out.stderr.strip()
    assert out.returncode == 3 and "Traceback" not in message and len(message.splitlines()) == 1, message
    for needle in needles:
        assert needle in message, message
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "llmctl-runs").exists()
