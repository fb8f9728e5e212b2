"""The runs list llmctl links to: MLflow's runs table showing the columns a training run is judged by.

MLflow 3.17's UI opens an experiment on its GenAI overview, and its runs table shows Created,
Dataset and Duration: no loss, no spend. Which columns it shows comes only from the browser's
localStorage (empty in a fresh profile) or from a saved view, an experiment tag
``mlflow.sharedViewState.<key>`` that a page address opens with ``viewStateShareKey=<key>``. So
llmctl saves one view on each experiment it runs in, and prints the address that opens it: the
losses, the spend, the model, the learning rate, the steps and the infra, newest run first, for
anyone with the link and nothing set up in their browser. The view also shows in the UI's list of
saved views, as ``llmctl``.

The tag's value is what the UI's "Save view" writes (read from MLflow 3.17.2's bundle): an envelope
``{"name", "createdAt", "updatedAt", "state"}`` whose ``state`` is the JSON of the runs page's
search facets and table state; a column is ``<metrics|params|tags|attributes>.`<name>```. The UI
takes the view only when the address has no sort or filter of its own (``searchFilter``,
``orderByKey``...), so the address carries none.

mlflow is not imported here: the caller hands in its client.
"""

from __future__ import annotations

import json
import time
from typing import Any

KEY = "llmctl"  # the view's id in the address (``viewStateShareKey``) and its name in the UI's list
TAG = f"mlflow.sharedViewState.{KEY}"  # the experiment tag the UI reads a saved view from
# the runs page (not the GenAI overview) whatever the browser last chose: MLflow 3.17's UI reads this
# query parameter first, then localStorage, then defaults to GenAI; the experiment's kind tag it ignores
ML_WORKFLOW = "workflowType=machine_learning"

# (kind, name, width in pixels), in this order after Run Name, Created and Duration: kind is the
# runs table's column group (metrics, params, tags). The widths fit the seven beside the UI's assistant
# panel in a 1920-pixel window, a float32 loss's 17 digits all but shown (the UI's default is 100).
COLUMNS = (
    ("metrics", "train/loss", 140),
    ("metrics", "val/loss", 140),
    ("metrics", "cost/actual_usd", 115),  # the spend: a tag, and a metric so a table sorts by it (ledger.CHARTED)
    ("params", "model.name", 85),
    ("params", "train.lr", 70),
    ("params", "train.steps", 85),
    ("tags", "llmctl.infra", 85),
)
DURATION = "duration"  # the Duration column's id: listed first in the order, so it stays before the seven


def column(kind: str, name: str) -> str:
    """A column's key as the UI's table state spells it: ``metrics.`train/loss```."""
    return f"{kind}.`{name}`"


def view_state() -> dict[str, Any]:
    """The runs page's state the view sets: its columns, newest run first, no filter (the UI puts
    these search keys into the page address once it opened the view). Table keys not set here keep
    the UI's defaults."""
    return {
        "searchFilter": "",
        "orderByKey": "attributes.start_time",
        "orderByAsc": False,
        "startTime": "ALL",
        "lifecycleFilter": "Active",
        "modelVersionFilter": "All Runs",
        "datasetsFilter": [],
        "selectedColumns": [column(kind, name) for kind, name, _ in COLUMNS],
        # the UI applies widths to the columns it is given an order for
        "columnOrder": [DURATION, *(column(kind, name) for kind, name, _ in COLUMNS)],
        "columnWidths": {column(kind, name): width for kind, name, width in COLUMNS},
    }


def view_tag_value(now_ms: int) -> str:
    """The tag's value: the UI's saved-view envelope around ``view_state``."""
    state = json.dumps(view_state(), separators=(",", ":"))
    return json.dumps({"name": KEY, "createdAt": now_ms, "updatedAt": now_ms, "state": state}, separators=(",", ":"))


def _same_view(value: str) -> bool:
    try:
        return bool(json.loads(json.loads(value)["state"]) == view_state())
    except (ValueError, KeyError, TypeError):
        return False


def save_view(mlflow_client: Any, experiment_id: str, tags: dict[str, str]) -> None:
    """Write the view on the experiment unless ``tags`` (the experiment's) already hold it: the next
    launches into it write nothing. llmctl owns the key: deleted in the UI, or changed by another
    llmctl, the view is written again at the next launch (the UI saves a user's own views under
    ids of their own). Errors propagate; a caller that must not fail over a view catches them."""
    if _same_view(tags.get(TAG, "")):
        return
    mlflow_client.set_experiment_tag(experiment_id, TAG, view_tag_value(int(time.time() * 1000)))


def runs_page(base: str, experiment_id: str) -> str:
    """The experiment's runs list in MLflow's UI served at ``base``, opened on llmctl's view."""
    return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs?{ML_WORKFLOW}&viewStateShareKey={KEY}"
