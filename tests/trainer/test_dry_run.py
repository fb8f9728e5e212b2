"""Full-size dry runs on this CPU: the real 70B model parallelised for 64 ranks (dp_shard 8 x tp 8)
and 8B for 8, on meta under torch's fake process group. Each rank holds 1/world of the parameters
(TP's replicated norms aside); the published parameter counts come out whole. Wall time is
recorded by ``llmctl plan --dry-run`` and docs/benchmarks.md, not asserted here."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "preset, world, parallel, published",
    [
        ("llama3.1-70b", 64, {"dp_shard": 8, "tp": 8}, 70_553_706_496),
        ("llama3.1-8b", 8, {"dp_shard": 8, "tp": 1}, 8_030_261_248),
    ],
)
def test_full_size_model_shards_over_the_target_world(preset: str, world: int, parallel: dict, published: int) -> None:
    from omegaconf import OmegaConf

    from workloads.pretrain.dry_run import sharded_params

    model = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "model" / f"{preset}.yaml"))
    # a plain mapping, as llmctl hands it over: sharded_params types it (config.typed)
    r = sharded_params({"model": model, "parallel": parallel, "train": {"batch_size": world}}, world)
    assert r["params_total"] == published
    assert r["layout"] == {"dp_replicate": 1, **parallel}
    even = published / world
    assert even <= r["params_per_rank"] <= even * 1.01, (r["params_per_rank"], even)
    if parallel["tp"] > 1:  # FSDP over TP shards: strided on the dp dim, then the tp dim
        assert r["wq_placements"][0].startswith("_S(0") and r["wq_placements"][1] == "S(0)", r["wq_placements"]
