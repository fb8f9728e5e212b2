"""Trial run names say what varies, from Hydra's own expansion of the sweep (``llmctl.sweep.naming``)."""

from __future__ import annotations

from llmctl.sweep.expand import expand
from llmctl.sweep.naming import names


def _trials(overrides: list[str]) -> list[dict]:
    return [{"index": i, "overrides": ovs} for i, ovs in enumerate(expand(overrides))]


def test_names_are_the_varying_overrides_and_distinct() -> None:
    trials = _trials(["experiment=smoke", "train.steps=5", "train.lr=1e-3,3e-3", "train.seed=0,1"])
    got = names(trials, "sweep-x")
    assert len(set(got.values())) == len(trials) == 4
    for t in trials:  # each name is exactly the trial's own values of the keys that vary
        given = dict(o.split("=", 1) for o in t["overrides"])
        assert got[t["index"]] == f"lr={given['train.lr']},seed={given['train.seed']}"


def test_nothing_varies_falls_back_to_the_sweep_name() -> None:
    trials = [{"index": 0, "overrides": ["train.lr=0.001"]}, {"index": 1, "overrides": ["train.lr=0.001"]}]
    assert names(trials, "sweep-x") == {0: "sweep-x-t0", 1: "sweep-x-t1"}
