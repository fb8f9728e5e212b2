"""The structure the features build on, checked from the source: the layering (which stage and
which workload may import what) as import-linter contracts in pyproject.toml, run here with
``lint-imports``; no import cycle among llmctl's modules; a protocol of the standard library alone;
every backend implementing the whole declared interface. Imports inside functions count
(grimp, which both use, reads every import statement)."""

from __future__ import annotations

import ast
import functools
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import grimp
import pytest
from helpers import ROOT

LINT_IMPORTS = str(Path(sys.executable).with_name("lint-imports"))


@functools.cache
def _graph() -> grimp.ImportGraph:
    return grimp.build_graph("llmctl", "workloads", include_external_packages=True, cache_dir=None)


def _imports_of(package: str) -> dict[str, set[str]]:
    """Each module of ``package`` (itself included) and what it imports directly."""
    graph = _graph()
    return {
        m: set(graph.find_modules_directly_imported_by(m))
        for m in sorted(graph.modules)
        if m == package or m.startswith(package + ".")
    }


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_import_contracts_hold() -> None:
    """pyproject.toml's [tool.importlinter] contracts: the workloads never import llmctl, the command
    workload nothing of the trainer, llmctl the workloads only through their contracts, the
    contracts no torch or numpy, each stage of llmctl only the stages below it."""
    out = subprocess.run([LINT_IMPORTS, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " 0 broken" in out.stdout and "KEPT" in out.stdout, out.stdout[-2000:]


def test_an_import_inside_a_function_breaks_a_contract(tmp_path: Path) -> None:
    """The check itself can fail: a forbidden import inside a function is seen and reported."""
    pkg = tmp_path / "layered"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "low.py").write_text("def f():\n    from layered import high\n    return high\n")
    (pkg / "high.py").write_text("")
    (tmp_path / ".importlinter").write_text(
        "[importlinter]\nroot_package = layered\n\n[importlinter:contract:down]\nname = low never imports high\n"
        "type = forbidden\nsource_modules = layered.low\nforbidden_modules = layered.high\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run(
        [LINT_IMPORTS, "--no-cache"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 1 and "BROKEN" in out.stdout and "layered.low -> layered.high" in out.stdout, out.stdout


def test_no_import_cycle_among_llmctl_modules() -> None:
    graph = {m: {d for d in deps if d.startswith("llmctl.")} for m, deps in _imports_of("llmctl").items()}
    assert {"llmctl.run.lifecycle", "llmctl.backends.local", "llmctl.cost.estimate", "llmctl.sweep.state"} <= set(graph)
    assert sum(map(len, graph.values())) > 100, "the graph holds llmctl's imports"
    assert _cycles(graph) == []
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_backend_implements_the_whole_interface() -> None:
    from llmctl.backends import registry
    from llmctl.backends.base import Backend

    methods = [n for n, v in vars(Backend).items() if callable(v) and not n.startswith("_")]
    assert {"plan", "preflight", "launch", "status", "logs", "down"} <= set(methods)
    backends = registry()
    assert set(backends) == {"local", "sky"}
    for kind, backend in backends.items():
        assert isinstance(backend, Backend) and backend.name == kind
        for method in methods:  # defined by the class itself, with the interface's parameters
            impl = vars(type(backend)).get(method)
            assert impl is not None, f"{kind} lacks {method}"
            want = list(inspect.signature(getattr(Backend, method)).parameters)
            assert list(inspect.signature(impl).parameters) == want, (kind, method)


# a user program's workload (``workload=command``): what llmctl and its node-side guard share
COMMAND_CONTRACT = "workloads.protocol.command"
# what every workload speaks with its launcher, owned by none of them
PROTOCOL = "workloads.protocol"


def _foreign(imports: set[str], allowed: tuple[str, ...] = ()) -> list[str]:
    """What of ``imports`` is neither the standard library nor ``allowed``."""
    return sorted(m for m in imports if m.split(".")[0] not in sys.stdlib_module_names and not m.startswith(allowed))


def test_the_protocol_is_stdlib_and_its_own() -> None:
    """Every workload and llmctl import the protocol: nothing heavy, no workload's code (omegaconf:
    ``config.py`` reads a YAML and its overrides with it when called, as the trainer does)."""
    found = set().union(*_imports_of(PROTOCOL).values())
    assert {"os", "fsspec"} <= found, "the scan sees the protocol's imports"
    assert _foreign(found, ("__future__", "fsspec", "omegaconf", PROTOCOL)) == []


def test_the_planner_is_stdlib_and_reads_only_the_protocol() -> None:
    """``llmctl plan`` and the trainer both import the planner: the standard library and the protocol
    (lm-eval's task index, when a request is checked)."""
    found = set().union(*_imports_of("workloads.planner").values())
    assert {"math", PROTOCOL + ".schema"} <= found, "the scan sees the planner's imports"
    assert _foreign(found, ("__future__", "lm_eval", PROTOCOL, "workloads.planner")) == []


def test_the_command_contract_is_stdlib() -> None:
    """``workloads/protocol/command.py`` reaches every ``llmctl plan``: the standard library only."""
    found = _imports_of(COMMAND_CONTRACT)[COMMAND_CONTRACT]
    assert found and _foreign(found, ("__future__",)) == [], found


def test_the_stdlib_check_can_fail() -> None:
    assert _foreign({"os", "json.decoder", "torch.nn", "fsspec"}, ("fsspec",)) == ["torch.nn"]


@pytest.mark.parametrize(
    "module",
    sorted(_imports_of("workloads.planner"))
    + sorted(_imports_of(PROTOCOL))
    + ["llmctl.cli", "llmctl.config.root_schema"],
)
def test_contract_modules_import_no_heavy_dependency(module: str) -> None:
    """What the CLI reads at start-up and what a launcher reads of the trainer's contract costs
    no torch, hydra, mlflow or sky import when imported."""
    code = (
        f"import sys; import {module}; "
        "print(sorted(m for m in ('torch', 'numpy', 'hydra', 'mlflow', 'sky', 'omegaconf') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_module_map_in_the_docs_matches_the_tree() -> None:
    """docs/concepts.md lists every folder (with a sentence on what belongs there) and every module
    once, and nothing that does not exist."""
    text = (ROOT / "docs" / "concepts.md").read_text()
    block = text.split("## Module map", 1)[1].split("```text", 1)[1].split("```", 1)[0]
    rows = [line.split(None, 1) for line in block.strip().splitlines()]
    listed = [r[0] for r in rows]
    assert len(listed) == len(set(listed)), "a module is listed twice"
    unexplained = [r[0] for r in rows if len(r) < 2 or len(r[1].split()) < 4]
    assert unexplained == [], f"listed without a sentence: {unexplained}"
    missing = [p for p in listed if not (ROOT / p).exists()]
    assert missing == [], f"listed but not in the tree: {missing}"
    tree = sorted(
        str(p.relative_to(ROOT))
        for pkg in ("llmctl", "workloads")
        for p in (ROOT / pkg).rglob("*.py")
        if p.name not in ("__init__.py", "__main__.py")
    )
    folders = sorted(
        str(p.parent.relative_to(ROOT)) + "/"
        for pkg in ("llmctl", "workloads")
        for p in (ROOT / pkg).rglob("__init__.py")
    )
    assert sorted(set(tree) - set(listed)) == [], "in the tree but not in docs/concepts.md's module map"
    assert sorted(set(folders) - set(listed)) == [], "a folder without its sentence in docs/concepts.md"


MAX_FUNCTION_LINES = 100  # issue #46: a function a reader holds in their head


def _long_functions(source: str, limit: int) -> list[tuple[str, int]]:
    """(name, lines) of every function or method in ``source`` longer than ``limit`` lines."""
    return [
        (node.name, node.end_lineno - node.lineno + 1)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > limit
    ]


def test_no_function_over_100_lines() -> None:
    long = {
        f"{path.relative_to(ROOT)}:{name}": lines
        for package in ("llmctl", "workloads")
        for path in sorted((ROOT / package).rglob("*.py"))
        for name, lines in _long_functions(path.read_text(), MAX_FUNCTION_LINES)
    }
    assert long == {}, f"split these (lines): {long}"


def test_the_length_check_can_fail() -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    assert _long_functions(f"def long():\n{body}", MAX_FUNCTION_LINES) == [("long", MAX_FUNCTION_LINES + 1)]
    assert _long_functions("def short():\n    return 1\n", MAX_FUNCTION_LINES) == []


def _test_switches(source: str) -> list[str]:
    """The fault and trace variables of tests/inject/sitecustomize.py that ``source`` names."""
    injector = (ROOT / "tests" / "inject" / "sitecustomize.py").read_text()
    switches = set(re.findall(r'"(LLMCTL_(?:TEST_\w+|FAIL_AT_STEP|LOSS_FILE|CKPT_PAUSE_S|EXIT_PAUSE_S))"', injector))
    return sorted(s for s in switches if s in source)


def test_no_product_module_exists_for_tests() -> None:
    """Faults and traces are injected from the tests (tests/inject): no module of llmctl or the
    workloads is a test hook, and none reads a variable the injector arms."""
    named = {
        str(path.relative_to(ROOT)): _test_switches(path.read_text())
        for package in ("llmctl", "workloads")
        for path in sorted((ROOT / package).rglob("*.py"))
    }
    assert {path: names for path, names in named.items() if names or "test" in Path(path).name} == {}


def test_the_test_switch_check_can_fail() -> None:
    assert _test_switches('int(os.environ.get("LLMCTL_FAIL_AT_STEP", "0"))') == ["LLMCTL_FAIL_AT_STEP"]
