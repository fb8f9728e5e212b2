"""Each backend's typed view of ``infra`` (``LocalSettings``, ``SkySettings``) against the one schema
users write (``InfraCfg``, conf/infra/*.yaml): same defaults, every key read by someone, the shipped
infra files accepted, and on ``infra=local`` a key only SkyPilot reads refused, not ignored. The
node run script is a real file and is what the task runs."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest
import yaml
from helpers import ROOT

from llmctl.backends.local import LAUNCHER_INFRA_KEYS, LocalSettings
from llmctl.backends.sky import task as sky_task
from llmctl.backends.sky.settings import SkySettings
from llmctl.config.root_schema import InfraCfg
from llmctl.errors import ConfigError

INFRA_FILES = sorted((ROOT / "conf" / "infra").glob("*.yaml"))


def _names(cls: type) -> set[str]:
    return {f.name for f in fields(cls)}


def test_every_infra_key_is_read_by_a_backend_or_by_llmctl() -> None:
    read = _names(SkySettings) | _names(LocalSettings) | set(LAUNCHER_INFRA_KEYS)
    assert sorted(_names(InfraCfg) - read) == []
    assert sorted((_names(SkySettings) | _names(LocalSettings)) - _names(InfraCfg)) == []  # no key of their own


@pytest.mark.parametrize("cls", [SkySettings, LocalSettings])
def test_settings_defaults_are_the_schemas(cls: type) -> None:
    schema, own = InfraCfg(), cls()
    assert {n: getattr(own, n) for n in _names(cls)} == {n: getattr(schema, n) for n in _names(cls)}


@pytest.mark.parametrize("path", INFRA_FILES, ids=[p.stem for p in INFRA_FILES])
def test_shipped_infra_files_build_their_backends_settings(path: Path) -> None:
    infra = {**vars(InfraCfg()), **yaml.safe_load(path.read_text())}
    if infra["kind"] == "local":
        assert LocalSettings.from_infra(infra) == LocalSettings(nproc_per_node=infra["nproc_per_node"])
    else:
        settings = SkySettings.from_infra(infra)
        assert settings.provider == infra["provider"] and settings.nodes == infra["nodes"]
        with pytest.raises(ConfigError):  # a SkyPilot infra file under kind=local is refused, not ignored
            LocalSettings.from_infra({**infra, "kind": "local"})


@pytest.mark.parametrize(
    "key, value, fix",
    [
        ("bucket", "s3://b/x", "Fix: infra.bucket=null"),
        ("use_spot", True, "Fix: infra.use_spot=false"),
        ("mount_bucket", False, "Fix: infra.mount_bucket=true"),
        ("pip_args", "--pre", "Fix: infra.pip_args=''"),
        ("accelerator_aliases", {"H100": "H100-SXM"}, "Fix: infra.accelerator_aliases={}"),
        ("nodes", 2, "Fix: infra.nodes=1"),
    ],
)
def test_local_refuses_what_only_skypilot_reads(key: str, value: object, fix: str) -> None:
    with pytest.raises(ConfigError) as err:
        LocalSettings.from_infra({**vars(InfraCfg()), key: value})
    message = str(err.value)
    assert message.startswith(f"Bad value for 'infra.{key}': ") and fix in message and "\n" not in message


def test_local_reads_its_own_keys_and_llmctls() -> None:
    infra = {**vars(InfraCfg()), "nproc_per_node": 3, "price_per_gpu_hour": 2.5, "name": "workstation"}
    assert LocalSettings.from_infra(infra) == LocalSettings(nproc_per_node=3)


def test_sky_settings_are_built_from_a_partial_section_and_copy_the_aliases() -> None:
    aliases = {"H100": "H100-SXM"}
    settings = SkySettings.from_infra({"provider": "runpod", "accelerators": "H100:8", "accelerator_aliases": aliases})
    assert settings.nodes == 1 and settings.accelerator_aliases == aliases
    aliases["A100"] = "A100-80GB"
    assert "A100" not in settings.accelerator_aliases
    assert sky_task.node_accelerators(settings) == ("H100-SXM", 8)
    assert SkySettings.of(settings) is settings


def test_the_node_run_script_is_a_file_and_is_the_tasks_run() -> None:
    script = ROOT / "llmctl" / "backends" / "sky" / "node_run.sh"
    assert script.read_text() == sky_task.RUN
    assert sky_task.RUN.startswith("set -euo pipefail\n") and "-m torch.distributed.run" in sky_task.RUN
