"""The interface every backend implements (``Backend``) and the values it answers with.

A backend runs what it is handed and reports on it; it never opens, closes or bills an MLflow run
(that is ``llmctl.run.lifecycle``'s job), so its answers are plain values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Protocol, TextIO, runtime_checkable

if TYPE_CHECKING:  # annotations only: a backend module needs neither at import time
    from llmctl.config.compose import Composed
    from llmctl.plan.job_plan import Plan
    from llmctl.tracking.mlflow_run import RunHandle


ENDED = ("FINISHED", "FAILED", "KILLED")  # MLflow statuses of a run whose job has ended: nothing of it runs


def log_name(job: str) -> str:
    """The controller's copy of a job's output in the run's folder: the workload's ``output.log`` (a
    resume appends to it), a ``score`` job's ``score.log`` (its newest)."""
    return "output.log" if job == "train" else f"{job}.log"


@dataclass
class JobStatus:
    """What a backend knows about a run's job: lines for ``llmctl status``, and whether it ended.

    ``ended`` is None while the job runs (or when the backend cannot tell), else the job's final
    state in the backend's words (SkyPilot's ``SUCCEEDED``, ``FAILED_SETUP`` ...), ``ok`` whether
    that is success, ``ended_at`` when: a RUNNING MLflow run whose job ended is then closed by the
    lifecycle and billed to that time, not to when someone looked.
    """

    lines: list[str] = field(default_factory=list)
    ended: Optional[str] = None
    ok: bool = False
    ended_at: Optional[float] = None  # when it ended (epoch seconds), as far as the backend knows


@runtime_checkable
class Backend(Protocol):
    """Everything llmctl asks of a place where jobs run. ``run`` is an MLflow ``Run``."""

    name: str

    def plan(self, composed: "Composed") -> "Plan":
        """How this config would run here: processes, mesh, hardware, offers. No side effects."""

    def preflight(self, plan: "Plan") -> None:
        """Checks that must pass before anything exists (credentials); raises ConfigError."""

    def finalize(self, plan: "Plan", handle: "RunHandle") -> dict[str, Any]:
        """Fill in what needs the run id (where checkpoints go); returns the config the workers get."""

    def launch(self, plan: "Plan", handle: "RunHandle", echo: Optional[TextIO] = None) -> int:
        """Run the job to its end, streaming its output; the job's exit code (0: success)."""

    def status(self, run: Any, uri: str) -> JobStatus:
        """The job's processes, cluster or managed job."""

    def alive(self, run: Any, uri: str) -> bool:
        """Whether the job may still be running (then a resume must not start a second writer)."""

    def logs(self, run: Any, uri: str, follow: bool) -> int:
        """Print the job's output; with ``follow``, until it ends. An exit code."""

    def down(self, run: Any, uri: str, force: bool = False) -> str:
        """Stop the job and release what it holds; ``force`` skips the graceful stop. One line of report.

        A run whose status is ``ENDED`` has no job: signal nothing (its recorded pids may be other
        processes' by now); only release what it still holds (a cluster kept up by ``infra.down=false``)."""
