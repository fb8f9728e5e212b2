"""tests/ci_policy.py, held against real pytest sessions (pytester, in a subprocess): under CI=true a skip
outside the GPU suite fails, elsewhere it stays a skip; a process a test leaves running is killed;
the documentation sessions are work units of their own."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import psutil
import pytest
from ci_policy import unit_times, work_unit

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[2]


def _session(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, ci: str | None, **files: str):
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "tests"))
    for name, body in files.items():
        path = pytester.path / f"{name}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(body))
    # a failed collection stops a session (as it stops CI); here the other outcomes are wanted too
    flags = ("-p", "ci_policy", "-p", "no:randomly", "-p", "no:cacheprovider", "-rA", "--continue-on-collection-errors")
    return pytester.runpytest_subprocess(*flags)


SKIPS = {
    "tests/llmctl/test_oracle": """
        import pytest

        def test_skipped_in_the_body():
            pytest.skip("peft is not installed")

        @pytest.mark.skipif(True, reason="no slurmctld")
        def test_skipped_by_a_mark():
            pass

        @pytest.mark.xfail(strict=True, reason="a known upstream bug")
        def test_expected_to_fail():
            assert False
    """,
    "tests/trainer/test_importorskip": """
        import pytest
        pytest.importorskip("a_module_that_is_not_there")

        def test_never_collected():
            pass
    """,
    "tests/gpu/test_cuda": """
        import pytest

        def test_needs_cuda():
            pytest.skip("no CUDA device")
    """,
}


@pytest.mark.parametrize("ci", ["true", "1", "TRUE"])
def test_a_skip_fails_in_ci_except_in_the_gpu_suite(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, ci: str
) -> None:
    result = _session(pytester, monkeypatch, ci, **SKIPS)
    # a skip in the body fails the test; one in setup (a skipif mark, a fixture's skip) errors it
    result.assert_outcomes(failed=1, errors=2, skipped=1, xfailed=1)
    out = result.stdout.str()
    assert re.search(r"FAILED tests/llmctl/test_oracle.py::test_skipped_in_the_body .*peft is not installed", out)
    assert re.search(r"ERROR tests/llmctl/test_oracle.py::test_skipped_by_a_mark .*no slurmctld", out)
    assert re.search(r"ERROR tests/trainer/test_importorskip.py .*a_module_that_is_not_there", out)
    assert "SKIPPED [1] tests/gpu/test_cuda.py" in out and "no CUDA device" in out


@pytest.mark.parametrize("ci", [None, "", "false", "0"])
def test_a_skip_stays_a_skip_outside_ci(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, ci: str | None
) -> None:
    result = _session(pytester, monkeypatch, ci, **SKIPS)
    result.assert_outcomes(skipped=4, xfailed=1)


def test_a_process_the_test_left_running_is_killed(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    pidfile = pytester.path / "pids"
    result = _session(
        pytester,
        monkeypatch,
        None,
        test_leak=f"""
        import subprocess, sys

        def test_leaves_a_sleeper():
            proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            shell = subprocess.Popen(["bash", "-c", "sleep 600 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
            open({str(pidfile)!r}, "w").write(f"{{proc.pid}} {{shell.stdout.readline().strip()}}")
        """,
    )
    result.assert_outcomes(passed=1)
    pids = [int(p) for p in pidfile.read_text().split()]
    assert len(pids) == 2
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"left running after the test: {alive}"


def test_the_documentation_sessions_are_work_units_of_their_own() -> None:
    assert work_unit("tests/e2e/test_docs.py::test_doc_commands_run[docs/eval.md]") == (
        "tests/e2e/test_docs.py::test_doc_commands_run[docs/eval.md]"
    )
    assert work_unit("tests/e2e/test_lifecycle.py::test_a[x]") == "tests/e2e/test_lifecycle.py"
    assert work_unit("tests/sky/test_slurm_launch.py::test_b") == "tests/sky/test_slurm_launch.py"


def test_the_suite_registers_the_policy(request: pytest.FixtureRequest) -> None:
    """tests/conftest.py hands the hooks to pytest; without it the policy above would hold in
    pytester sessions only."""
    hook = request.config.pluginmanager.hook
    for name in ("pytest_runtest_makereport", "pytest_make_collect_report", "pytest_runtest_call"):
        owners = [impl.plugin_name for impl in getattr(hook, name).get_hookimpls()]
        assert any(owner.endswith("tests/conftest.py") for owner in owners), (name, owners)
    if request.config.pluginmanager.hasplugin("xdist"):
        owners = [impl.plugin_name for impl in hook.pytest_xdist_make_scheduler.get_hookimpls()]
        assert any(owner.endswith("tests/conftest.py") for owner in owners), owners


def test_ci_run_exports_ci_true() -> None:
    script = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^export CI=true\b", script, re.M), ".ci/run must export CI=true before the tests"
    assert script.index("export CI=true") < script.index("pytest"), "CI=true must be set before pytest runs"


def test_the_longest_units_start_first(request: pytest.FixtureRequest) -> None:
    """The collection the workers take units from is sorted by tests/unit_times.tsv, longest first;
    every unit the file names is still one of the suite's (a renamed file would silently go last)."""
    seconds = unit_times()
    units = [work_unit(item.nodeid) for item in request.session.items]
    known = [seconds[u] for u in units if u in seconds]
    assert known == sorted(known, reverse=True)
    for unit in seconds:
        path, _, test = unit.partition("::")
        assert (ROOT / path).is_file(), f"tests/unit_times.tsv names {unit}: refresh it (.ci/report.py unit-times)"
        function = test.partition("[")[0]
        assert not function or f"def {function}(" in (ROOT / path).read_text(), f"{unit} is gone: refresh it"
