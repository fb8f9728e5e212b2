"""Every command shown in the docs runs, so the docs cannot rot.

The ```bash blocks of README.md and docs/**/*.md are read as one shell session per file: their lines
run in order in a fresh directory, with the test environment (private HOME holding SkyPilot's
fixture catalogs, the shared tokenizer cache, no MLflow/cloud variables). Rules the docs follow:

- ``llmctl ...`` runs as written and must exit 0, or N when the line ends in ``# exit N``.
- ``<run-id>`` is the newest run of the session (when none exists yet, a 10-step local run is
  launched first); ``<sweep-id>`` the newest sweep. Any other ``<placeholder>`` fails the test.
- A ```text block right after a ```bash block is output its last command must print (whitespace
  normalized): the error messages in troubleshooting.md are checked verbatim this way.
- Lines that need the outside world are not run: installs (pip, venv, activate), ``mlflow ui``,
  ``sky ...``, and the benchmarks (minutes each, one needs a GPU; docs/benchmarks.md records their
  runs). ``llmctl launch``/``resume`` with a non-local ``infra=`` run as ``llmctl plan`` with
  the same overrides (no cloud account or remote cluster here; the real Slurm launch is
  tests/sky/test_slurm_launch.py). Each substitution is printed.
- Any other line (``mkdir``, ``printf ... > file``) runs with bash in the session directory.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import ROOT

sys.path.insert(0, str(ROOT / "tests" / "sky"))
from sky_helpers import install_catalog

FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n?", re.S | re.M)
EXIT = re.compile(r"#\s*exit\s+(\d+)\s*$")
PLACEHOLDER = re.compile(r"<[a-z][a-z0-9-]*>")
NOT_RUN = re.compile(
    r"^(pip|python3? -m (venv|pip)|\. \S*activate|source |mlflow ui|sky |git clone|cd |python3? benchmarks/)"
)
REMOTE_INFRA = re.compile(r"^infra=(?!local$)")


@dataclass
class Step:
    line: str  # as shown in the doc
    expected_exit: int
    expect_output: str  # normalized text that must appear in the output ("" for none)


def _norm(text: str) -> str:
    return " ".join(text.split())


def steps(doc: Path) -> list[Step]:
    """The runnable lines of a doc, in order, each with its expected exit code and output."""
    text = doc.read_text()
    blocks = list(FENCE.finditer(text))
    out: list[Step] = []
    for i, block in enumerate(blocks):
        if block.group(1) != "bash":
            continue
        lines = []
        for raw in block.group(2).splitlines():
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            code = EXIT.search(line)
            if "&&" in line and "llmctl " in line:  # an install chain ending in the llmctl command
                line = line[line.rindex("&&") + 2 :].strip()
            if NOT_RUN.match(line):
                continue
            lines.append(Step(line, int(code.group(1)) if code else 0, ""))
        nxt = blocks[i + 1] if i + 1 < len(blocks) else None
        if lines and nxt is not None and nxt.group(1) == "text" and not text[block.end() : nxt.start()].strip():
            lines[-1].expect_output = _norm(nxt.group(2))
        out += lines
    return out


def _newest(workdir: Path, sweep: bool) -> str | None:
    if not (workdir / "mlflow.db").exists():
        return None
    from mlflow.tracking import MlflowClient

    mc = MlflowClient(tracking_uri=f"sqlite:///{workdir / 'mlflow.db'}")
    exps = [e.experiment_id for e in mc.search_experiments()]
    for run in mc.search_runs(exps, order_by=["attributes.start_time DESC"], max_results=50):
        tags = run.data.tags
        if sweep and tags.get("llmctl.sweep_id"):
            return tags["llmctl.sweep_id"]
        if not sweep and tags.get("llmctl.kind") != "sweep":
            return run.info.run_id
    return None


def _run(args: list[str], workdir: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmctl", *args],
        cwd=workdir,
        env=env,
        text=True,
        capture_output=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )


def _resolve(line: str, workdir: Path, env: dict[str, str]) -> str:
    if "<run-id>" in line and _newest(workdir, sweep=False) is None:
        seed = _run(["launch", "experiment=smoke", "train.steps=10", "checkpoint.every=5"], workdir, env)
        assert seed.returncode == 0, seed.stdout[-2000:] + seed.stderr[-2000:]
        print("  (a 10-step local run was launched for <run-id>)")
    for name, sweep in (("<run-id>", False), ("<sweep-id>", True)):
        if name in line:
            value = _newest(workdir, sweep)
            assert value, f"{name} used before any {'sweep' if sweep else 'run'} exists in this doc"
            line = line.replace(name, value)
    unknown = PLACEHOLDER.findall(line.split("#")[0])
    assert not unknown, f"unknown placeholder(s) {unknown} in: {line}"
    return line


def _llmctl_args(line: str) -> list[str]:
    """The arguments of an llmctl line; a cloud launch/resume becomes the plan of the same overrides."""
    args = shlex.split(line, comments=True)[1:]
    if args and args[0] in ("launch", "resume") and any(REMOTE_INFRA.match(a) for a in args):
        rest = args[1:]
        if args[0] == "resume":  # the run's own overrides live in MLflow; plan what the line asks for
            rest = rest[1:]
        print(f"  substituted: llmctl plan {' '.join(rest)}  (needs a cloud account to run as written)")
        return ["plan", *rest]
    return args


# The documents with something to run; the rest (prose, tables) are not collected, rather than skipped.
DOCS = [doc for doc in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))] if steps(doc)]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_doc_commands_run(doc: Path, tmp_path: Path, cli_env: dict[str, str]) -> None:
    todo = steps(doc)
    workdir = tmp_path / "session"
    workdir.mkdir()
    (workdir / "examples").symlink_to(ROOT / "examples")  # the docs run in a checkout: its examples are there
    install_catalog(Path(cli_env["HOME"]))
    env = {
        **cli_env,
        "AWS_EC2_METADATA_DISABLED": "true",
        "COLUMNS": "200",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{cli_env.get('PATH', '')}",
    }
    for step in todo:
        line = _resolve(step.line, workdir, env)
        print(f"$ {line}")
        if line.startswith("llmctl "):
            out = _run(_llmctl_args(line), workdir, env)
        else:
            out = subprocess.run(
                ["bash", "-c", line.split(" # ")[0]], cwd=workdir, env=env, text=True, capture_output=True, timeout=300
            )
        shown = out.stdout + out.stderr
        assert out.returncode == step.expected_exit, (
            f"{doc.name}: `{step.line}` exited {out.returncode}, expected {step.expected_exit}\n{shown[-4000:]}"
        )
        if step.expect_output:
            assert step.expect_output in _norm(shown), (
                f"{doc.name}: `{step.line}` no longer prints what the doc shows:\n"
                f"expected: {step.expect_output}\ngot: {shown[-3000:]}"
            )


def test_config_reference_covers_every_key_and_option() -> None:
    """docs/config.md names every schema key and every option of every config group."""
    from llmctl.config.root_schema import schema_keys

    text = (ROOT / "docs" / "config.md").read_text()
    missing = [k for k in schema_keys() if "." in k and f"`{k}`" not in text]  # leaves; sections have no dot
    assert not missing, f"docs/config.md lacks: {missing}"
    options = [(p.parent.name, p.stem) for p in sorted((ROOT / "conf").glob("*/*.yaml"))]
    assert options
    section = text.split("## Groups", 1)[1].split("## Keys", 1)[0]
    absent = [f"{g}={o}" for g, o in options if f"`{o}`" not in section or f"`{g}`" not in section]
    assert not absent, f"docs/config.md lacks the group option(s): {absent}"


# A key row of docs/config.md's tables: | `section.key` | type | default | meaning |
KEY_ROW = re.compile(r"^\|\s*`([a-z_]+(?:\.[a-z_0-9]+)+)`\s*\|(.*)$", re.M)


def _cells(rest: str) -> list[str]:
    """The cells after the key cell; ``\\|`` (an escaped bar, in enum types) stays inside its cell."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", rest)]


def _schema_type(hint) -> str:
    """A schema field's type as docs/config.md writes it: int, float, bool, str, enum options
    ``a|b``, ``list[str]``, ``map``; ``?`` appended when it may be null."""
    import enum
    import typing

    args = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Union and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        return _schema_type(inner) + "?"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return "|".join(m.value for m in hint)
    if typing.get_origin(hint) is list:
        return f"list[{_schema_type(args[0])}]"
    if typing.get_origin(hint) is dict:
        return "map"
    return hint.__name__


def _doc_default(text: str, hint):
    """The default a row writes, read as the field's type (``null``, ``true``, ``1e-5``, ``""``,
    ``["a", "b"]``, ``{}``; backticks around it are decoration)."""
    import enum
    import json
    import typing

    text = text.strip().strip("`")
    if text == "null":
        return None
    args = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Union and type(None) in args:
        (hint,) = [a for a in args if a is not type(None)]
    if hint is bool:
        return {"true": True, "false": False}[text]
    if hint is int:
        return int(text)
    if hint is float:
        return float(text)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return hint(text)
    if hint is str:
        return json.loads(text) if text.startswith('"') else text
    return json.loads(text)  # list, map


def _schema_fields() -> dict:
    """{"section.key": (type hint, default)} of every leaf of llmctl's root schema (the trainer's
    sections, ``workloads.protocol.schema``, plus ``infra`` and ``tracking``)."""
    import typing
    from dataclasses import MISSING, fields, is_dataclass

    from llmctl.config.root_schema import RootCfg

    out = {}

    def leaves(prefix: str, cls) -> None:  # a nested group of keys (model.lora) adds its own leaves
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            if is_dataclass(hints[f.name]):
                leaves(f"{prefix}.{f.name}", hints[f.name])
                continue
            default = f.default if f.default is not MISSING else f.default_factory()
            out[f"{prefix}.{f.name}"] = (hints[f.name], default)

    for section, cls in typing.get_type_hints(RootCfg).items():
        leaves(section, cls)
    return out


def config_reference_drift(text: str) -> list[str]:
    """Every way docs/config.md's key tables disagree with the schema: a row whose type or
    default is not the field's, a row for no field, a field with no row (or two)."""
    schema = _schema_fields()
    keys_part = text.split("## Keys", 1)[1]
    problems, seen = [], []
    for key, rest in KEY_ROW.findall(keys_part):
        seen.append(key)
        if key not in schema:
            problems.append(f"{key}: a row for a key the schema does not have")
            continue
        hint, default = schema[key]
        cells = _cells(rest)
        doc_type, doc_default = cells[0].replace("`", "").replace("\\|", "|"), cells[1]
        if doc_type != _schema_type(hint):
            problems.append(f"{key}: type written {doc_type!r}, the schema's is {_schema_type(hint)!r}")
        try:
            written = _doc_default(doc_default, hint)
        except (ValueError, KeyError) as exc:
            problems.append(f"{key}: default {doc_default!r} is not a {_schema_type(hint)} ({exc})")
            continue
        if written != default or type(written) is not type(default):
            problems.append(f"{key}: default written {doc_default!r}, the schema's is {default!r}")
    for key in schema:
        if seen.count(key) != 1:
            problems.append(f"{key}: {seen.count(key)} rows in the key tables (want 1)")
    return problems


def test_config_reference_types_and_defaults_are_the_schemas() -> None:
    """Each key row of docs/config.md states the schema field's type and default, exactly."""
    assert not config_reference_drift((ROOT / "docs" / "config.md").read_text())


@pytest.mark.parametrize(
    "row, broken, needle",
    [
        ("| `model.dim` | int | 128 |", "| `model.dim` | float | 128 |", "model.dim: type written 'float'"),
        ("| `model.dim` | int | 128 |", "| `model.dim` | int | 256 |", "model.dim: default written '256'"),
        (
            "| `train.dtype` | `auto`\\|`fp32`\\|`bf16` |",
            "| `train.dtype` | `fp32`\\|`bf16` |",
            "train.dtype: type written",
        ),
        ("| `eval.top_k` | int? | 50 |", "| `eval.top_k` | int | 50 |", "eval.top_k: type written 'int'"),
        ("| `infra.down` | bool | true |", "| `infra.down` | bool | false |", "infra.down: default written"),
        ("| `train.lr` | float | 3e-3 |", "| `train.lr` | float | 3e-4 |", "train.lr: default written '3e-4'"),
    ],
)
def test_config_reference_check_catches_a_wrong_type_or_default(row: str, broken: str, needle: str) -> None:
    text = (ROOT / "docs" / "config.md").read_text()
    assert row in text
    problems = config_reference_drift(text.replace(row, broken))
    assert any(needle in p for p in problems), problems


def test_every_schema_field_says_what_it_means() -> None:
    """Each field of the trainer's schema has its meaning beside it: a comment on its line or the
    lines just above, or its name in the class docstring."""
    import ast

    path = ROOT / "workloads" / "protocol" / "schema.py"
    lines = path.read_text().splitlines()
    undocumented = []
    for cls in ast.parse(path.read_text()).body:
        if not (isinstance(cls, ast.ClassDef) and cls.name.endswith("Cfg")):
            continue
        doc = ast.get_docstring(cls) or ""
        for node in cls.body:
            if not isinstance(node, ast.AnnAssign):
                continue
            name = node.target.id
            own = lines[node.lineno - 1 : node.end_lineno]
            above = lines[node.lineno - 2].strip() if node.lineno > 1 else ""
            if not (any("#" in ln for ln in own) or above.startswith("#") or f"``{name}``" in doc):
                undocumented.append(f"{cls.name}.{name}")
    assert not undocumented, f"schema fields without a meaning beside them: {undocumented}"


def test_ci_workflow_is_valid_and_runs_smoke() -> None:
    import yaml

    text = (ROOT / "docs" / "ci.md").read_text()
    (block,) = [m.group(2) for m in FENCE.finditer(text) if m.group(1) == "yaml"]
    workflow = yaml.safe_load(block)
    steps_ = workflow["jobs"]["smoke"]["steps"]
    runs = "\n".join(s.get("run", "") for s in steps_)
    assert "torch==2.13.0" in runs and "whl/cpu" in runs, "a pinned CPU torch"
    assert re.search(r"^llmctl smoke\b", runs, re.M)
    assert any(s.get("uses", "").startswith("actions/checkout") for s in steps_)


def test_steps_parser_reads_the_conventions(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text(
        "```bash\npip install -e . && llmctl plan  # comment\nllmctl plan train.lr=abc   # exit 3\n"
        "```\n\n```text\nBad value  for 'train.lr'\n```\n"
    )
    got = steps(doc)
    assert [(s.line, s.expected_exit) for s in got] == [
        ("llmctl plan  # comment", 0),
        ("llmctl plan train.lr=abc   # exit 3", 3),
    ]
    assert got[1].expect_output == "Bad value for 'train.lr'"
    assert _llmctl_args("llmctl launch infra=aws train.steps=5  # x") == ["plan", "infra=aws", "train.steps=5"]
    assert _llmctl_args("llmctl launch infra=local") == ["launch", "infra=local"]
