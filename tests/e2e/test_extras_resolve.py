"""The docs' install lines leave a working environment in every order the docs show them: the
base install, then ``.[hf]`` and ``.[cloud]`` one after the other (either way round) or together,
and ``.[eval]`` (lm-eval) or ``.[hf,peft]`` after both or before ``.[cloud]``.

Installing them for real takes minutes and gigabytes (torch, SkyPilot's clouds, MLflow), so the
environment is pip's own view of one: a venv whose site-packages holds only the ``.dist-info``
metadata of what pip reports it would install (``pip install --dry-run --report``), step after
step, each step resolved by pip against what the earlier steps left (pip reads installed packages
from that metadata, as it would from real ones), and ``pip check`` at the end. The failure this
guards against, ``.[cloud]`` downgrading huggingface-hub under a transformers that needs a newer
one, is a broken requirement ``pip check`` reports, and the same version check transformers runs
when it is imported. Needs PyPI (CI has it): skipped without it locally, failed in CI. Marked
``network``: plain ``pytest`` leaves it out (without a warm pip cache it waits on PyPI for ten
minutes and more, a worker's share of the suite); ``.ci/run`` runs it beside the suite with
``pytest -m network``.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from helpers import ROOT

# each line as the docs show it (checked below), and where
BASE = ("README.md", "pip install torch==2.13.0 -e .")
HF = ("docs/finetune.md", 'pip install -e ".[hf]"')
CLOUD = ("docs/quickstart.md", 'pip install -e ".[cloud]"')
BOTH = ("docs/finetune.md", 'pip install -e ".[cloud,hf]"')
EVAL = ("docs/eval.md", 'pip install -e ".[eval]"')  # lm-eval: its datasets caps fsspec, its hub and click float
PEFT = ("docs/finetune.md", 'pip install -e ".[hf,peft]"')  # what loads a --format peft export
ORDERS = {
    "hf, then cloud": [HF, CLOUD],
    "cloud, then hf": [CLOUD, HF],
    "in one line": [BOTH],
    "cloud and hf, then eval": [BOTH, EVAL],
    "eval, then cloud": [EVAL, CLOUD],
    "cloud and hf, then peft": [BOTH, PEFT],
    "peft, then cloud": [PEFT, CLOUD],
}


def _canon(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


class PipView:
    """A venv holding only installed packages' metadata, changed as pip reports it would change it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        if not (root / "bin" / "python").exists():
            subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
        self.python = root / "bin" / "python"
        code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
        self.site = Path(subprocess.run([str(self.python), "-c", code], capture_output=True, text=True).stdout.strip())

    def copy(self, root: Path) -> PipView:
        shutil.copytree(self.root, root, symlinks=True)
        return PipView(root)

    def pip(self, *args: str) -> subprocess.CompletedProcess[str]:
        """This interpreter's pip acting on the view (``pip --python``), from the repository root."""
        cmd = [sys.executable, "-m", "pip", "--python", str(self.python), "--disable-pip-version-check", *args]
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)

    def install(self, line: str) -> list[dict[str, Any]]:
        """Resolve one doc line (``pip install ...``) against the view and apply pip's report."""
        args = shlex.split(line)[2:]
        report = self.root / "report.json"
        out = self.pip("install", "--dry-run", "--quiet", "--report", str(report), *args)
        assert out.returncode == 0, f"{line}: {out.stderr[-3000:]}"
        installs = json.loads(report.read_text())["install"]
        for item in installs:
            self._write(item["metadata"])
        return installs

    def _write(self, meta: dict[str, Any]) -> None:
        for old in self.site.glob("*.dist-info"):
            name = next((ln[6:] for ln in (old / "METADATA").read_text().splitlines() if ln.startswith("Name: ")), "")
            if _canon(name) == _canon(meta["name"]):
                shutil.rmtree(old)
        info = self.site / f"{_canon(meta['name']).replace('-', '_')}-{meta['version']}.dist-info"
        info.mkdir(parents=True)
        lines = ["Metadata-Version: 2.1", f"Name: {meta['name']}", f"Version: {meta['version']}"]
        lines += [f"Requires-Dist: {r}" for r in meta.get("requires_dist") or []]
        lines += [f"Provides-Extra: {e}" for e in meta.get("provides_extra") or []]
        (info / "METADATA").write_text("\n".join(lines) + "\n")
        (info / "INSTALLER").write_text("pip\n")
        (info / "RECORD").write_text("")

    def versions(self) -> dict[str, str]:
        out = self.pip("list", "--format", "json")
        return {_canon(p["name"]): p["version"] for p in json.loads(out.stdout)}


def test_the_lines_are_the_docs() -> None:
    for doc, line in (BASE, HF, CLOUD, BOTH, EVAL, PEFT):
        assert line in (ROOT / doc).read_text(), f"{doc} no longer shows {line}"


def _pypi_reachable() -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen("https://pypi.org/simple/skypilot/", timeout=15):
            return True
    except OSError:
        return False


@pytest.mark.network
@pytest.mark.timeout(2400)
def test_the_extras_resolve_together_in_every_order_the_docs_show(tmp_path: Path) -> None:
    if not _pypi_reachable():
        pytest.skip("PyPI is not reachable: the docs' install lines cannot be resolved")
    base = PipView(tmp_path / "base")
    base.install(BASE[1])
    # Orders that share their first steps share the views those steps left (``cloud and hf, then
    # eval`` starts from the view ``in one line`` ends with): each distinct step from each distinct
    # view is resolved once, level by level, the steps of a level side by side (pip waits on PyPI).
    views: dict[tuple[str, ...], PipView] = {(): base}

    def step(where: str, prefix: tuple[str, ...]) -> None:
        view = views[prefix[:-1]].copy(tmp_path / where)
        view.install(prefix[-1])
        views[prefix] = view

    for depth in range(1, max(len(lines) for lines in ORDERS.values()) + 1):
        level = sorted({tuple(line for _, line in lines[:depth]) for lines in ORDERS.values() if len(lines) >= depth})
        with ThreadPoolExecutor(len(level)) as pool:
            list(pool.map(step, [f"view-{depth}-{k}" for k in range(len(level))], level))

    def check(name: str) -> tuple[str, dict[str, str], str]:
        view = views[tuple(line for _, line in ORDERS[name])]
        out = view.pip("check")
        return name, view.versions(), out.stdout + out.stderr if out.returncode else ""

    with ThreadPoolExecutor(len(ORDERS)) as pool:
        results = list(pool.map(check, ORDERS))
    for name, versions, broken in results:
        assert not broken, f"{name}: {broken}"
        assert {"transformers", "skypilot", "huggingface-hub", "llmctl-train"} <= set(versions), (name, versions)
    # the same transformers, SkyPilot and huggingface-hub whichever way they were installed
    key = {name: {p: v[p] for p in ("transformers", "skypilot", "huggingface-hub")} for name, v, _ in results}
    assert len({json.dumps(k, sort_keys=True) for k in key.values()}) == 1, key
