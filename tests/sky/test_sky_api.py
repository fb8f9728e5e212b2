"""SkyPilot 0.14's client API as llmctl calls it, held against the real library's own logic."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from llmctl.backends.sky import backend as sky_backend

SOURCE = Path(sky_backend.__file__).read_text()


@pytest.fixture
def inside_a_job_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment SkyPilot's jobs controller gives a task of a job group (job 41, root 40)."""
    from sky.skylet import constants

    monkeypatch.setenv(constants.MANAGED_JOB_ID_ENV_VAR, "41")
    monkeypatch.setenv(constants.ROOT_JOB_ID_ENV_VAR, "40")
    monkeypatch.setenv(constants.TASK_ID_ENV_VAR, "sky-managed-2026-11-25_trainer_41-0")


def test_a_runs_managed_job_never_joins_the_launching_job_group(inside_a_job_group: None) -> None:
    """Launched from inside a job group (a sweep supervisor running as a managed job), SkyPilot's
    default would attach the run's job to that group; llmctl's value resolves to no attachment."""
    from sky.jobs.client import sdk

    assert sdk._resolve_job_group(sdk.AUTO_JOB_GROUP).parent_job_id == 41  # the default would attach
    ours = sdk._resolve_job_group(sky_backend.MANAGED_JOB_GROUP)
    assert ours.parent_job_id is None and not ours.attaches
    assert "job_group=MANAGED_JOB_GROUP" in inspect.getsource(sky_backend._launch_managed)


def test_every_teardown_and_job_cancel_is_graceful_and_every_keyword_exists() -> None:
    """``graceful=True`` lets cached bucket uploads (the newest checkpoint) finish before SkyPilot
    stops. Each keyword llmctl passes must exist in the real signature: a wrong one raises TypeError,
    which the quiet teardown paths would swallow. (``sky.cancel``, a cluster job's cancel, has no
    ``graceful``: the cluster's own ``down`` is where the upload is waited for.)"""
    import sky

    calls = re.findall(r"sky\.((?:jobs\.)?(?:down|cancel|launch))\(([^()]*(?:\([^()]*\)[^()]*)*)\)", SOURCE)
    assert len(calls) >= 6, calls
    for name, args in calls:
        fn = (
            sky.jobs.launch
            if name == "jobs.launch"
            else sky.jobs.cancel
            if name == "jobs.cancel"
            else getattr(sky, name)
        )
        keywords = re.findall(r"(\w+)=", args)
        assert set(keywords) <= set(inspect.signature(fn).parameters), (name, keywords)
        if name in ("down", "jobs.cancel"):
            assert "graceful=True" in args, f"sky.{name}({args}) is not graceful"


def test_managed_launch_returns_a_list_of_job_ids() -> None:
    """0.14's ``jobs.launch`` request returns ``(job_ids, handle)`` with a list of ids."""
    from sky.jobs.client import sdk

    doc = inspect.getsource(sdk.launch)
    assert re.search(r"job_ids \(Optional\[List\[int\]\]\]?\)", doc), "SkyPilot's launch no longer returns a list"
    assert "job_ids[0] if isinstance(job_ids, list)" in inspect.getsource(sky_backend._launch_managed)


def test_terminal_job_states_are_skypilots_own() -> None:
    """A job is over exactly when SkyPilot says so, for cluster jobs and managed jobs alike: a
    state llmctl took for terminal too early would close a live run (and end its bill); one it
    missed would leave a finished run RUNNING. ``WAITING``/``PENDING``/``RECOVERING`` are not over."""
    from sky.jobs.state import ManagedJobStatus
    from sky.skylet.job_lib import JobStatus

    ours = sky_backend.TERMINAL_OK | sky_backend.TERMINAL_BAD
    theirs = {s.value for s in ManagedJobStatus if s.is_terminal()} | {s.value for s in JobStatus if s.is_terminal()}
    assert ours == theirs
    assert {"SUCCEEDED"} == sky_backend.TERMINAL_OK
