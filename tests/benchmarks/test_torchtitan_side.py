"""torchtitan's side of ``benchmarks/gpu_vs_torchtitan.py``, on CPU, through the benchmark's own code.

``benchmarks/titan_sides.py`` builds both sides; these tests run it on a tiny shape (torchtitan's
"debugmodel" cut to 2 blocks, seq 64) for one training step, and check that both sides count the
same FLOPs/token for every shape the benchmark runs, so a torchtitan API change fails here, not in
the GPU session. torchtitan's heavy dependencies (datasets, wandb, tensorboard...) are not needed:
the ``titan`` fixture installs the pinned release with ``--no-deps`` into a temporary directory,
with only what its model code imports (``titan_sides.TORCHTITAN_IMPORTS``), unless that exact
version is importable already.

CPU differences from the GPU run, in these tests only: torchtitan's attention is its own
``ScaledDotProductAttention`` (``attn="sdpa"``), since FlexAttention has no backward on CPU (its
mask construction is still checked, forward-only); the model and loss run eager
(``compile_model=False, compile_loss=False``: inductor on 2 CPU cores takes minutes). Precision is
the benchmark's default ``fsdp`` (FSDP2 on a 1-rank gloo mesh, bf16 parameters).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import math
import sys

import pytest
import torch

if sys.version_info < (3, 11):  # torchtitan 0.3.0 requires it (and tomllib is 3.11+)
    pytest.skip("torchtitan needs Python >= 3.11", allow_module_level=True)
import tomllib
from helpers import ROOT, pip_target

sys.path.insert(0, str(ROOT / "benchmarks"))
import titan_sides as ts

SEQ, BATCH = 64, 2
# Our conf spelling of torchtitan's "debugmodel" (dim 256, 16 heads, FFN 768, vocab 2048, untied).
TINY = {
    "dim": 256,
    "n_heads": 16,
    "n_kv_heads": 16,
    "vocab_size": 2048,
    "multiple_of": 256,
    "ffn_dim_multiplier": None,
    "tie_embeddings": False,
    "rope_theta": 500000.0,
}


@pytest.fixture(scope="module")
def titan(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The pinned torchtitan, importable; its version."""
    want = ts.TORCHTITAN.split("==")[1]
    try:
        have = importlib.metadata.version("torchtitan")
    except importlib.metadata.PackageNotFoundError:
        have = None
    if have != want:
        target = tmp_path_factory.mktemp("torchtitan")
        got = pip_target(target, ts.TORCHTITAN, *ts.TORCHTITAN_IMPORTS)
        assert got.returncode == 0, f"could not install {ts.TORCHTITAN} from PyPI: {got.stderr[-800:]}"
        sys.path.insert(0, str(target))
        importlib.invalidate_caches()
    assert importlib.metadata.version("torchtitan") == want
    return want


@pytest.fixture()
def process_group():
    """The 1-rank gloo group ``one_rank_mesh`` starts, torn down so no later test inherits it."""
    import torch.distributed as dist

    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_pin_is_the_bench_extra() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["bench"] == [ts.TORCHTITAN]


def _one_step(side: ts.Side, vocab: int) -> tuple[float, int, int]:
    """Loss, parameters changed, parameters in all, after fwd + loss + bwd + AdamW step."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g)
    params = [p for p in side.model.parameters() if p.requires_grad]
    before = [p.detach().full_tensor().clone() if hasattr(p, "full_tensor") else p.detach().clone() for p in params]
    opt = torch.optim.AdamW(params, lr=1e-3)
    with side.autocast():
        loss = side.loss(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    opt.step()
    after = [p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in params]
    changed = sum(not torch.equal(b, a) for b, a in zip(before, after))
    return float(loss.detach()), changed, len(params)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])  # 8B / 1B
def test_torchtitan_side_trains_one_step(titan: str, process_group: None, tied: bool) -> None:
    torch.manual_seed(0)
    cfg = ts.titan_config("debugmodel", n_layers=2, attn="sdpa")
    if tied:  # as its "1B" config ties: the embedding's own init skipped, the LM head's kept
        from torchtitan.models.common.param_init import skip_param_init

        cfg.enable_weight_tying = True
        cfg.tok_embeddings.param_init = {"weight": skip_param_init}
    side = ts.titan_side(
        cfg, SEQ, BATCH, torch.device("cpu"), precision="fsdp", compile_model=False, compile_loss=False
    )
    assert side.model._skip_lm_head  # its chunked loss applies the LM head
    assert (side.model.lm_head.weight is side.model.tok_embeddings.weight) == tied
    loss, changed, total = _one_step(side, cfg.vocab_size)
    assert math.isfinite(loss), loss
    if not tied:
        # Uniform predictions give ln V; torchtitan's LM head init (std dim^-0.5 on unit-RMS
        # states) gives logits of std ~1, which adds ~0.5 in expectation. Tied, a 2-block model
        # at init mostly predicts its input token (the normed residual is still its own
        # embedding, so that logit is ~sqrt(dim) * |e| = 16): the loss on random targets is ~14.
        assert abs(loss - math.log(cfg.vocab_size)) < 1.0, loss
    assert changed == total, f"{total - changed} of {total} parameters did not change"


def test_our_side_trains_one_step(process_group: None) -> None:
    torch.manual_seed(0)
    cfg = ts.ours_cfg("tiny", n_layers=2, **TINY)
    side = ts.ours_side(cfg, SEQ, torch.device("cpu"), precision="fsdp", compile_model=False)
    loss, changed, total = _one_step(side, cfg.vocab_size)
    assert math.isfinite(loss) and abs(loss - math.log(cfg.vocab_size)) < 1.0, loss
    assert changed == total, f"{total - changed} of {total} parameters did not change"


def test_flex_mask_is_torchtitans_block_mask(titan: str) -> None:
    """The default attention's mask builds (forward-only check: Flex has no CPU backward)."""
    from torch.nn.attention.flex_attention import BlockMask

    cfg = ts.titan_config("debugmodel", n_layers=1, attn="flex")
    with torch.device("meta"):
        model = cfg.build()
    positions = torch.arange(128).expand(BATCH, 128)
    mask = model.get_attention_masks(positions=positions)
    assert isinstance(mask, BlockMask) and mask.shape[-2:] == (128, 128)


@pytest.mark.parametrize(("shape", "layers"), [("tiny", 2), ("1b", None), ("8b", None), ("8b", 10)])
def test_both_sides_count_the_same_flops(titan: str, shape: str, layers: int | None) -> None:
    seq = SEQ if shape == "tiny" else 4096
    if shape == "tiny":
        ours, theirs = ts.ours_cfg("tiny", layers, **TINY), ts.titan_config("debugmodel", layers, "sdpa")
    else:
        ours_name, flavor = ts.SHAPES[shape]
        ours, theirs = ts.ours_cfg(ours_name, layers), ts.titan_config(flavor, layers)
    from workloads.protocol.shape import flops_per_token

    assert flops_per_token(ours, seq) == ts.titan_flops(theirs, seq)


def test_benchmark_knobs_are_checked_up_front(monkeypatch: pytest.MonkeyPatch) -> None:
    import gpu_vs_torchtitan as bench

    default = "autocast" if ts.torch_predates_titan() else "fsdp"  # torch < 2.13: see the next test
    assert bench.settings()["precision"] == default and bench.settings()["tt_attn"] == "flex"
    for key, bad in (
        ("GPU_BENCH_TT_ATTN", "flash"),
        ("GPU_BENCH_PRECISION", "fp16"),
        ("GPU_BENCH_SHAPES", "1b,70b"),
        ("GPU_BENCH_BATCH", "0"),
        ("GPU_BENCH_8B_LAYERS", "ten"),
    ):
        with monkeypatch.context() as m:
            m.setenv(key, bad)
            with pytest.raises(ValueError, match=key):
                bench.settings()


def test_torch_before_2_13_runs_both_sides_under_autocast(capsys: pytest.CaptureFixture[str]) -> None:
    """torchtitan 0.3.0's FSDP side dies in backward on torch 2.11 (the GPU machine's): both sides
    switch to autocast there, and say why."""
    assert ts.runnable_precision("fsdp", "2.11.0+cu130") == "autocast"
    assert "autocast instead of fsdp on both sides: torch 2.11.0+cu130 < 2.13" in capsys.readouterr().out
    assert ts.runnable_precision("fsdp", "2.13.0+cpu") == "fsdp"
    assert ts.runnable_precision("fp32", "2.11.0") == "fp32"
    assert capsys.readouterr().out == ""


def test_import_shim_stands_in_only_for_what_torch_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed.fsdp as fsdp

    if hasattr(fsdp, "DataParallelMeshDims"):  # torch >= 2.13: left alone
        real = fsdp.DataParallelMeshDims
        ts.titan_import_shim()
        assert fsdp.DataParallelMeshDims is real
        monkeypatch.delattr(fsdp, "DataParallelMeshDims")  # now as on torch 2.11
    ts.titan_import_shim()
    with pytest.raises(NotImplementedError, match="needs torch >= 2.13"):
        fsdp.DataParallelMeshDims()
