"""The structure the features build on, checked from the source: one direction of dependency
(the workload never imports llmctl), no import cycle among llmctl's modules (imports inside
functions included), and every backend implementing the whole declared interface."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(package: str) -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((ROOT / package).rglob("*.py"))}


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """Every module ``path`` imports, anywhere in the file (functions, ``TYPE_CHECKING`` blocks too).
    ``from a import b`` counts as ``a.b`` when that is a module, else as ``a``."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                pkg = name.split(".") if is_package else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - node.level + 1]
                base = ".".join(pkg + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)
    return found


def _graph(package: str) -> dict[str, set[str]]:
    mods = _modules(package)
    return {
        name: {m for m in _imports(path, name, set(mods)) if m in mods and m != name} for name, path in mods.items()
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


def test_the_workload_imports_nothing_from_llmctl() -> None:
    mods = _modules("workloads")
    assert len(mods) > 15, "the scan found the workload's modules"
    offenders = {
        name: sorted(m for m in _imports(path, name, set(mods)) if m == "llmctl" or m.startswith("llmctl."))
        for name, path in mods.items()
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_scan_sees_imports_inside_functions(tmp_path: Path) -> None:
    """The checker itself: a function-level import and a relative one are found (else both tests above
    could pass on a tree full of them)."""
    src = tmp_path / "mod.py"
    src.write_text("def f():\n    from llmctl.cost import ledger\n    from . import sibling\n")
    found = _imports(src, "pkg.mod", {"llmctl.cost.ledger", "pkg.sibling"})
    assert found == {"llmctl.cost.ledger", "pkg.sibling"}
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle_among_llmctl_modules() -> None:
    graph = _graph("llmctl")
    assert {"llmctl.run.lifecycle", "llmctl.backends.local", "llmctl.cost.estimate", "llmctl.sweep.state"} <= set(graph)
    assert _cycles(graph) == []


def test_data_flows_one_way() -> None:
    """Backends and the cost model never reach back into what calls them."""
    graph = _graph("llmctl")
    upstream = {
        "llmctl.cli",
        "llmctl.run.lifecycle",
        "llmctl.run.attached",
        "llmctl.run.closing",
        "llmctl.run.resume",
        "llmctl.plan.make",
        "llmctl.sweep.control",
        "llmctl.sweep.supervisor",
        "llmctl.sweep.trial_plans",
    }
    for name, deps in graph.items():
        if name.startswith(("llmctl.backends", "llmctl.cost")):
            assert not deps & upstream, (name, sorted(deps & upstream))
    assert "llmctl.backends" not in graph["llmctl.cost.estimate"] and not any(
        d.startswith("llmctl.backends") for d in graph["llmctl.cost.estimate"]
    )


def test_folders_import_only_later_stages() -> None:
    """By folder: the stages below a folder never import it back (config and the controller's
    machinery are the ground floor; tracking never reaches into running or planning; backends
    never into the run lifecycle, sweeps or the CLI)."""
    graph = _graph("llmctl")
    forbidden = {
        "llmctl.config": (
            "llmctl.plan",
            "llmctl.run",
            "llmctl.backends",
            "llmctl.tracking",
            "llmctl.sweep",
            "llmctl.cost",
            "llmctl.controller",
            "llmctl.cli",
        ),
        "llmctl.controller": (
            "llmctl.plan",
            "llmctl.run",
            "llmctl.backends",
            "llmctl.tracking",
            "llmctl.sweep",
            "llmctl.cost",
            "llmctl.cli",
        ),
        "llmctl.tracking": ("llmctl.plan", "llmctl.run", "llmctl.backends", "llmctl.sweep", "llmctl.cli"),
        "llmctl.backends": ("llmctl.run", "llmctl.sweep", "llmctl.cli", "llmctl.plan.make"),
        "llmctl.run": ("llmctl.sweep", "llmctl.cli"),
    }
    offenders = sorted(
        (name, dep)
        for name, deps in graph.items()
        for folder, banned in forbidden.items()
        if name.startswith(folder + ".")
        for dep in deps
        if dep.startswith(banned)
    )
    assert offenders == []


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


CONTRACT = "workloads.pretrain.contract"
# a user program's workload (``workload=command``): what llmctl and its node-side guard share
COMMAND_CONTRACT = "workloads.command.contract"
# what every workload speaks with its launcher, owned by none of them
PROTOCOL = "workloads.protocol"


def test_llmctl_imports_only_the_trainers_contract() -> None:
    """llmctl reads the trainer through its stdlib contract package alone, and a command workload
    through its stdlib contract module; everything else of the workloads (torch, the guard) runs as
    a process (torchrun, ``python -m workloads.pretrain.<entry>``, ``python -m workloads.command``)."""
    known = set(_modules("workloads")) | set(_modules("llmctl"))
    reached = {
        (name, m)
        for name, path in _modules("llmctl").items()
        for m in _imports(path, name, known)
        if m.startswith("workloads")
    }
    assert any(m.startswith(CONTRACT + ".") for _, m in reached), "the scan sees llmctl's contract imports"
    assert any(m == COMMAND_CONTRACT for _, m in reached), "the scan sees the command contract's imports"
    assert any(m.startswith(PROTOCOL + ".") for _, m in reached), "the scan sees the protocol's imports"
    allowed = (CONTRACT + ".", PROTOCOL + ".")
    outside = sorted(
        (name, m)
        for name, m in reached
        if m not in (CONTRACT, COMMAND_CONTRACT, PROTOCOL) and not m.startswith(allowed)
    )
    assert outside == [], (
        f"llmctl imports workload modules outside {CONTRACT}, {PROTOCOL} and {COMMAND_CONTRACT}: {outside}"
    )


def test_the_command_workload_imports_nothing_of_the_trainer() -> None:
    """A user's program runs under the protocol, not under the bundled trainer's package."""
    mods = _modules("workloads/command")
    reached = {(name, m) for name, path in mods.items() for m in _imports(path, name, set(_modules("workloads")))}
    assert any(m.startswith(PROTOCOL + ".") for _, m in reached), "the scan sees the guard's protocol imports"
    assert sorted((n, m) for n, m in reached if m.startswith("workloads.pretrain")) == []


def test_the_protocol_is_stdlib_and_its_own() -> None:
    """Every workload and llmctl import the protocol: nothing heavy, no workload's code."""
    mods = _modules("workloads/protocol")
    found = {m for name, path in mods.items() for m in _imports(path, name, set(_modules("workloads")))}
    assert found, "the scan sees the protocol's imports"
    foreign = sorted(
        m
        for m in found
        if m.split(".")[0] not in sys.stdlib_module_names
        and m not in ("__future__", "fsspec")
        and not m.startswith(PROTOCOL)
    )
    assert foreign == [], f"the protocol imports {foreign}"


def test_the_command_contract_is_stdlib() -> None:
    """``workloads/command/contract.py`` reaches every ``llmctl plan``: the standard library only."""
    path = ROOT / "workloads" / "command" / "contract.py"
    found = _imports(path, COMMAND_CONTRACT, set(_modules("workloads")))
    assert found and all(m.split(".")[0] in sys.stdlib_module_names or m == "__future__" for m in found), found


def test_the_contract_imports_no_torch_or_numpy() -> None:
    """Anywhere in the contract's files (functions too): torch or numpy there would reach every
    ``llmctl plan``; and the contract stays within itself, the protocol every workload speaks (which
    sits below all of them) and the standard library's neighbours."""
    mods = _modules("workloads/pretrain/contract")
    assert len(mods) >= 10, sorted(mods)
    heavy = {
        (name, m)
        for name, path in mods.items()
        for m in _imports(path, name, set(_modules("workloads")))
        if m.split(".")[0] in ("torch", "numpy", "triton", "torchao", "transformers", "safetensors")
    }
    assert heavy == set()
    inward = {
        (name, m)
        for name, path in mods.items()
        for m in _imports(path, name, set(_modules("workloads")))
        if m.startswith("workloads") and not m.startswith((CONTRACT, PROTOCOL + "."))
    }
    assert inward == set(), "the contract imports the rest of the trainer"


def test_the_contract_check_can_fail(tmp_path: Path) -> None:
    """The scans above see a torch import inside a function and a trainer import from llmctl."""
    src = tmp_path / "m.py"
    src.write_text("def f():\n    import torch.nn\n    from workloads.pretrain.model import transformer\n")
    found = _imports(src, "llmctl.x", {"workloads.pretrain.model.transformer"})
    assert found == {"torch.nn", "workloads.pretrain.model.transformer"}


@pytest.mark.parametrize(
    "module",
    sorted(_modules("workloads/pretrain/contract"))
    + sorted(_modules("workloads/protocol"))
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
