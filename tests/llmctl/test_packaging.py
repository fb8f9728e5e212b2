"""The wheel: the config tree ships inside it, so an installed llmctl finds conf/ without a clone; the
wheel the nodes get (``llmctl.distribution.wheel``) is built from the working tree, and from an
installed distribution it is packed back from the installed files; both are the controller's build."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from helpers import ROOT

from llmctl.distribution.identity import describe
from llmctl.distribution.wheel import wheel_for_nodes


def _in(site: Path, code: str, cwd: Path) -> str:
    """``code``'s output in a Python that imports llmctl from ``site`` alone (not this checkout)."""
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", "HOME": str(cwd)},
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


@pytest.mark.slow
def test_the_nodes_wheel_carries_conf_and_is_this_build(tmp_path: Path) -> None:
    wheel = wheel_for_nodes(tmp_path / "cache")
    assert wheel.name.startswith("llmctl_train-") and wheel_for_nodes(tmp_path / "cache") == wheel  # built once
    names = set(zipfile.ZipFile(wheel).namelist())
    for expected in (
        "llmctl/conf/config.yaml",
        "llmctl/conf/model/1b.yaml",
        "llmctl/conf/infra/local.yaml",
        "llmctl/conf/experiment/smoke.yaml",
        "workloads/pretrain/train.py",
        "llmctl/cli.py",
        "llmctl/backends/sky/node_run.sh",  # what every SkyPilot node runs, read beside its module
    ):
        assert expected in names, expected
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    conf = _in(site, "from llmctl.config.compose import conf_dir; print(conf_dir())", tmp_path)
    assert Path(conf) == site / "llmctl" / "conf"
    # the installed files are this checkout's build: a node running them passes the version check
    assert _in(site, "from llmctl.distribution.identity import describe; print(describe())", tmp_path) == describe()


@pytest.mark.slow
def test_an_installed_llmctl_packs_its_own_files_back_into_the_same_build(tmp_path: Path) -> None:
    """No checkout: the installed distribution (pip's unpacked wheel, with its RECORD) is repacked."""
    site = tmp_path / "site"
    zipfile.ZipFile(wheel_for_nodes(tmp_path / "cache")).extractall(site)
    code = "from pathlib import Path; from llmctl.distribution.wheel import wheel_for_nodes as w; print(w(Path('c')))"
    repacked = tmp_path / _in(site, code, tmp_path)
    assert repacked.is_relative_to(tmp_path / "c") and repacked.name.startswith("llmctl_train-0")
    again = tmp_path / "again"
    with zipfile.ZipFile(repacked) as zf:
        record = zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/RECORD"))).decode()
        assert "llmctl/cli.py,sha256=" in record and "INSTALLER" not in record
        zf.extractall(again)
    assert _in(again, "from llmctl.distribution.identity import describe; print(describe())", tmp_path) == describe()


@pytest.mark.slow
def test_the_metadata_is_what_a_registry_accepts(tmp_path: Path) -> None:
    """The wheel's METADATA as PyPI reads it (``packaging.metadata``, which PyPI's upload path uses, with
    validation): our name, the version from its one place, a readme, a license, classifiers, URLs."""
    import trove_classifiers
    from packaging.metadata import Metadata

    import llmctl

    wheel = wheel_for_nodes(tmp_path / "cache")
    with zipfile.ZipFile(wheel) as zf:
        raw = zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA")))
        names = zf.namelist()
    meta = Metadata.from_email(raw, validate=True)  # raises on any field a registry would refuse
    assert str(meta.name) == "llmctl-train" and str(meta.version) == llmctl.__version__
    assert meta.description_content_type == "text/markdown" and "# llmctl" in (meta.description or "")
    assert str(meta.license_expression) == "Apache-2.0" and any(n.endswith("licenses/LICENSE") for n in names)
    assert meta.requires_python is not None and meta.project_urls and meta.summary
    assert meta.classifiers and set(meta.classifiers) <= trove_classifiers.classifiers


# an install command naming llmctl itself (bare, with extras or a version): llmctl on PyPI is an unrelated
# project; ours is llmctl-train (a checkout's `-e .` and `.[extra]` name no package); the arguments end
# where the shell's command does (&&, ;, |) or a comment starts
INSTALLS_THE_STRANGER = re.compile(
    r"""(pip|pipx|uv pip|uv tool) install\b[^\n`&;|#]*?(?<![\w./-])['"]?llmctl(\[[^\]]*\])?(?=['"\s`<>=~!]|$)"""
)


def test_no_message_or_page_tells_a_user_to_install_a_package_we_do_not_own() -> None:
    roots = ["README.md", "docs", "llmctl", "workloads", "benchmarks", "examples", "conf", "tests", ".ci"]
    offenders = []
    for root in roots:
        base = ROOT / root
        for path in [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file()):
            if path.suffix not in {".md", ".py", ".sh", ".yaml", ".toml", ".txt", ""} or "__pycache__" in path.parts:
                continue
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if INSTALLS_THE_STRANGER.search(line) and path != Path(__file__):
                    offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
    # the pattern finds what it is for
    for line in (
        "pip install llmctl",
        "pip install 'llmctl[cloud]'",
        'uv tool install "llmctl==0.1"',
        "pipx install llmctl",
    ):
        assert INSTALLS_THE_STRANGER.search(line), line
    for line in ("pip install 'llmctl-train[cloud]'", 'pip install -e ".[cloud]"', "pip install -e . && llmctl launch"):
        assert not INSTALLS_THE_STRANGER.search(line), line
