"""The docs' install lines leave a working environment in every order the docs show them: the
base install, then ``.[hf]`` and ``.[cloud]`` one after the other (either way round) or together,
``.[eval]`` (lm-eval) or ``.[hf,peft]`` after both or before ``.[cloud]``, the storage extras
(``s3``, ``gcs``, ``data``) before and after ``.[eval]`` and before and after ``.[cloud]``, and
every user-facing extra in one line (docs/quickstart.md), which pip must resolve without
backtracking: no candidate rejected, so pip's notice "pip is looking at multiple versions of ..."
never shows (before the storage extras' bounds it took pip over five minutes of trying s3fs, gcsfs,
boto3 and huggingface-hub releases; the time it takes now is printed, ``-s`` shows it, never asserted).

Installing them for real takes minutes and gigabytes (torch, SkyPilot's clouds, MLflow), so the
environment is pip's own view of one: a venv whose site-packages holds only the ``.dist-info``
metadata of what pip reports it would install (``pip install --dry-run --report``), step after
step, each step resolved by pip against what the earlier steps left (pip reads installed packages
from that metadata, as it would from real ones), and ``pip check`` at the end. The failures this
guards against are broken requirements ``pip check`` reports: ``.[cloud]`` downgrading
huggingface-hub under a transformers that needs a newer one (the same version check transformers
runs when it is imported), ``.[s3]`` lifting fsspec above the cap of ``.[eval]``'s datasets, or
downgrading botocore under ``.[cloud]``'s boto3. Lines the docs write with the published name,
``pip install 'llmctl-train[x]'``, are resolved as ``.[x]`` of this checkout: the distribution is not
on PyPI yet, and this checkout's requirements are what it will publish. Needs PyPI (CI has it):
skipped without it locally, failed in CI. Marked ``network``: plain ``pytest`` leaves it out (without
a warm pip cache it waits on PyPI for ten minutes and more, a worker's share of the suite);
``.ci/run`` runs it beside the suite with ``pytest -m network``.
"""

from __future__ import annotations

import functools
import json
import re
import shlex
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from compatible_index import compatible_index
from helpers import ROOT

# each line as the docs show it (checked below), and where
BASE = ("README.md", "pip install torch==2.13.0 -e .")
HF = ("docs/finetune.md", 'pip install -e ".[hf]"')
CLOUD = ("docs/quickstart.md", 'pip install -e ".[cloud]"')
BOTH = ("docs/finetune.md", 'pip install -e ".[cloud,hf]"')
EVAL = ("docs/eval.md", 'pip install -e ".[eval]"')  # lm-eval: its datasets caps fsspec, its hub and click float
PEFT = ("docs/finetune.md", 'pip install -e ".[hf,peft]"')  # what loads a --format peft export
# s3fs: pins fsspec to its own release, and aiobotocore, whose botocore window .[cloud]'s boto3 must share
S3 = ("docs/config.md", "pip install 'llmctl-train[s3]'")
GCS = ("docs/config.md", "pip install 'llmctl-train[gcs]'")  # gcsfs: its floor on fsspec rises with its release
DATA = ("docs/config.md", "pip install 'llmctl-train[data]'")  # pyarrow and the s3 extra's s3fs
# every user-facing extra at once (not gpu: Linux and CUDA only; not bench: Python >= 3.11, an older datasets)
ALL = ("docs/quickstart.md", 'pip install -e ".[cloud,hf,peft,eval,s3,gcs,data,qlora,fp8,system]"')
# one extra for one feature, as the pages that need it show it (each after the base install)
FP8 = ("docs/benchmarks.md", "pip install 'llmctl-train[fp8]'")  # torchao
QLORA = ("docs/benchmarks.md", "pip install 'llmctl-train[qlora]'")  # torchao
SYSTEM = ("README.md", 'pip install -e ".[system]"')  # psutil, NVML
GPU = ("docs/config.md", "pip install 'llmctl-train[gpu]'")  # Liger's kernels (brings triton)
BENCH = ("docs/benchmarks.md", 'pip install -e ".[bench,gpu]"')  # torchtitan: its own datasets and fsspec
DEV_GPU = ("docs/benchmarks.md", 'pip install -e ".[dev,gpu]"')  # the suite and the GPU suite
# installed, not cloned (the published name, resolved as this checkout's .[cloud])
INSTALLED = ("README.md", "pip install torch==2.13.0 'llmctl-train[cloud]'")
ORDERS = {
    "every extra in one line": [ALL],
    "installed with the cloud extra": [INSTALLED],
    "fp8": [FP8],
    "qlora": [QLORA],
    "system": [SYSTEM],
    "gpu": [GPU],
    "bench and gpu": [BENCH],
    "dev and gpu": [DEV_GPU],
    "hf, then cloud": [HF, CLOUD],
    "cloud, then hf": [CLOUD, HF],
    "in one line": [BOTH],
    "cloud and hf, then eval": [BOTH, EVAL],
    "eval, then cloud": [EVAL, CLOUD],
    "cloud and hf, then peft": [BOTH, PEFT],
    "peft, then cloud": [PEFT, CLOUD],
    "eval, then s3": [EVAL, S3],
    "s3, then eval": [S3, EVAL],
    "eval, then gcs": [EVAL, GCS],
    "gcs, then eval": [GCS, EVAL],
    "eval, then data": [EVAL, DATA],
    "data, then eval": [DATA, EVAL],
    "cloud, then s3": [CLOUD, S3],
    "s3, then cloud": [S3, CLOUD],
    "cloud, then gcs": [CLOUD, GCS],
    "gcs, then cloud": [GCS, CLOUD],
    "cloud, then data": [CLOUD, DATA],
    "data, then cloud": [DATA, CLOUD],
}
# what each extra is installed for: the environment of every order that installs it holds these
PROVIDES = {
    "cloud": ("skypilot",),
    "hf": ("transformers",),
    "peft": ("peft",),
    "eval": ("lm-eval",),
    "s3": ("s3fs",),
    "gcs": ("gcsfs",),
    "data": ("pyarrow", "s3fs"),
    "qlora": ("torchao",),
    "fp8": ("torchao",),
    "system": ("psutil", "nvidia-ml-py"),
    "gpu": ("liger-kernel",),
    "bench": ("torchtitan",),
    "dev": ("pytest", "skypilot", "lm-eval"),
}
# the orders whose environments hold the first packages hold the second at one version, whichever
# way round (or in one line) they were installed
AGREE = [
    (("skypilot", "transformers"), ("transformers", "skypilot", "huggingface-hub")),
    (("skypilot", "s3fs"), ("s3fs", "aiobotocore", "botocore", "boto3")),
    (("skypilot", "gcsfs"), ("gcsfs", "skypilot")),
    (("datasets", "s3fs"), ("datasets", "s3fs", "fsspec")),
    (("datasets", "gcsfs"), ("datasets", "gcsfs", "fsspec")),
]
RESOLVERS = 4  # pip resolutions at once
# pip's notice when the resolver rejects a candidate and tries another release (logged at info level)
BACKTRACKED = re.compile(r"pip is looking at multiple versions of (\S+)")


def _canon(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def pip_args(line: str) -> list[str]:
    """The arguments of a doc's ``pip install`` line; the published name, not on PyPI yet, as this checkout."""
    return ["." + a[len("llmctl-train") :] if a.startswith("llmctl-train[") else a for a in shlex.split(line)[2:]]


def as_wheel(args: list[str], wheel: Path) -> list[str]:
    """``pip_args`` with this checkout (``.``, ``-e .``) as its built wheel: the same metadata (checked), and
    pip reads it from the file instead of building the checkout's metadata in a fresh isolated
    environment for every resolution (~8 CPU-s each)."""
    out: list[str] = []
    for arg in args:
        if arg.startswith(".") and out[-1:] == ["-e"]:
            out.pop()
        out.append(f"{wheel}{arg[1:]}" if arg.startswith(".") else arg)
    return out


def extras(line: str) -> list[str]:
    """The extras a line installs: ``.[cloud,hf]`` or ``'llmctl-train[cloud,hf]'``, cloud and hf."""
    found = re.search(r"\[([a-z0-9,]+)\]", line)
    return found.group(1).split(",") if found else []


class PipView:
    """A venv holding only installed packages' metadata, changed as pip reports it would change it."""

    def __init__(self, root: Path, index_url: str, checkout: Path) -> None:
        self.root = root
        self.index_url = index_url
        self.checkout = checkout  # this checkout's wheel, resolved where a line installs ``.``
        if not (root / "bin" / "python").exists():
            subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
        self.python = root / "bin" / "python"
        code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
        self.site = Path(subprocess.run([str(self.python), "-c", code], capture_output=True, text=True).stdout.strip())

    def copy(self, root: Path) -> PipView:
        shutil.copytree(self.root, root, symlinks=True)
        return PipView(root, self.index_url, self.checkout)

    def pip(self, *args: str) -> subprocess.CompletedProcess[str]:
        """This interpreter's pip acting on the view (``pip --python``), from the repository root."""
        cmd = [sys.executable, "-m", "pip", "--python", str(self.python), "--disable-pip-version-check", *args]
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)

    def install(self, line: str) -> str:
        """Resolve one doc line (``pip install ...``) against the view, apply pip's report; pip's log."""
        report = self.root / "report.json"
        args = as_wheel(pip_args(line), self.checkout)
        out = self.pip("install", "--dry-run", "--index-url", self.index_url, "--report", str(report), *args)
        assert out.returncode == 0, f"{line}: {out.stderr[-3000:]}"
        for item in json.loads(report.read_text())["install"]:
            self._write(item["metadata"])
        return out.stdout + out.stderr

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
    for doc, line in sorted({BASE} | {step for lines in ORDERS.values() for step in lines}):
        assert line in (ROOT / doc).read_text(), f"{doc} no longer shows {line}"


def test_the_published_name_resolves_as_this_checkout() -> None:
    assert pip_args(S3[1]) == [".[s3]"]
    assert pip_args(BOTH[1]) == ["-e", ".[cloud,hf]"]
    assert pip_args(BASE[1]) == ["torch==2.13.0", "-e", "."]
    assert extras(S3[1]) == ["s3"] and extras(BOTH[1]) == ["cloud", "hf"] and extras(BASE[1]) == []
    assert set(extras(ALL[1])) <= set(PROVIDES), "an extra the all-extras line installs has no PROVIDES entry"
    wheel = Path("/w/llmctl_train-0.1.0-py3-none-any.whl")
    assert as_wheel(pip_args(BOTH[1]), wheel) == [f"{wheel}[cloud,hf]"]
    assert as_wheel(pip_args(BASE[1]), wheel) == ["torch==2.13.0", str(wheel)]
    assert as_wheel(pip_args(S3[1]), wheel) == [f"{wheel}[s3]"]


def _pypi_reachable() -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen("https://pypi.org/simple/skypilot/", timeout=15):
            return True
    except OSError:
        return False


@pytest.mark.network
@pytest.mark.timeout(3600)  # a hang guard: .ci/run runs it at a low priority beside the suite
def test_the_extras_resolve_together_in_every_order_the_docs_show(tmp_path: Path) -> None:
    if not _pypi_reachable():
        pytest.skip("PyPI is not reachable: the docs' install lines cannot be resolved")
    wheel = _checkout_wheel(tmp_path / "wheel")
    with compatible_index(sys.executable) as index_url:
        _resolve_every_order(PipView(tmp_path / "base", index_url, wheel), tmp_path)


def _checkout_wheel(where: Path) -> Path:
    """This checkout built as a wheel once, its metadata the same as pip reads from ``-e .``."""
    run = functools.partial(subprocess.run, cwd=ROOT, capture_output=True, text=True, check=True, timeout=600)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    run([*pip, "wheel", "--no-deps", "--wheel-dir", str(where), "."])
    (wheel,) = where.glob("llmctl_train-*.whl")
    reports = {}
    for name, target in (("editable", ["-e", "."]), ("wheel", [str(wheel)])):
        report = where / f"{name}.json"
        run([*pip, "install", "--dry-run", "--no-deps", "--ignore-installed", "--report", str(report), *target])
        reports[name] = json.loads(report.read_text())["install"][0]["metadata"]
    fields = ("name", "version", "requires_dist", "provides_extra", "requires_python")
    assert {f: reports["wheel"].get(f) for f in fields} == {f: reports["editable"].get(f) for f in fields}, reports
    return wheel


def _resolve_every_order(base: PipView, tmp_path: Path) -> None:
    base.install(BASE[1])
    # Orders that share their first steps share the views those steps left (``cloud and hf, then
    # eval`` starts from the view ``in one line`` ends with): each distinct step from each distinct
    # view is resolved once, level by level, the steps of a level side by side (pip waits on PyPI).
    views: dict[tuple[str, ...], PipView] = {(): base}
    logs: dict[tuple[str, ...], tuple[float, str]] = {}

    def step(where: str, prefix: tuple[str, ...]) -> None:
        view = views[prefix[:-1]].copy(tmp_path / where)
        start = time.monotonic()
        log = view.install(prefix[-1])
        logs[prefix] = time.monotonic() - start, log
        views[prefix] = view

    # the line with every extra first and alone, so that the time it prints is its own
    step("view-all", (ALL[1],))
    for depth in range(1, max(len(lines) for lines in ORDERS.values()) + 1):
        level = sorted(
            {tuple(line for _, line in lines[:depth]) for lines in ORDERS.values() if len(lines) >= depth} - set(views)
        )
        # a few at a time: pip mostly waits on PyPI, but each resolution parses metadata on a CPU the
        # suite beside it needs too (CI runs this beside the main suite)
        with ThreadPoolExecutor(RESOLVERS) as pool:
            list(pool.map(step, [f"view-{depth}-{k}" for k in range(len(level))], level))
    for prefix, (seconds, log) in logs.items():
        tried = sorted(set(BACKTRACKED.findall(log)))
        alone = " (alone)" if prefix == (ALL[1],) else ""
        note = f"  [pip tried several releases of {', '.join(tried)}]" if tried else ""
        print(f"{seconds:4.0f} s{alone}: {' && '.join(prefix)}{note}")

    def check(name: str) -> tuple[str, dict[str, str], str]:
        view = views[tuple(line for _, line in ORDERS[name])]
        out = view.pip("check")
        return name, view.versions(), out.stdout + out.stderr if out.returncode else ""

    with ThreadPoolExecutor(RESOLVERS) as pool:
        results = list(pool.map(check, ORDERS))
    for name, versions, broken in results:
        assert not broken, f"{name}: {broken}"
        wanted = {"llmctl-train"} | {p for _, line in ORDERS[name] for x in extras(line) for p in PROVIDES[x]}
        assert wanted <= set(versions), (name, sorted(wanted - set(versions)))
    for held, same in AGREE:
        seen = {name: {p: v[p] for p in same} for name, v, _ in results if set(held) <= set(v)}
        assert len(seen) >= 2, (held, seen)  # the orders the rule is about were resolved
        # the same versions whichever way they were installed
        assert len({json.dumps(k, sort_keys=True) for k in seen.values()}) == 1, seen

    # every extra in one line: pip took each package's first candidate, trying no other release
    seconds, log = logs[(ALL[1],)]
    assert "Would install" in log, log[-3000:]  # pip's info-level log is on: a backtracking notice would show
    tried = sorted(set(BACKTRACKED.findall(log)))
    assert not tried, f"{ALL[1]}: pip tried several releases of {tried} ({seconds:.0f} s)"
