"""The transformer blocks compile as one graph each, with no graph break, under every setting the trainer
combines with ``model.compile``: each AC mode, FSDP2, bf16 (autocast, or FSDP's bf16 parameters), the
document mask, eval under ``no_grad``, and FP8.

Dynamo decides graph breaks and recompiles before any device code runs and the blocks have no device
branches, so a CPU run sees what a GPU run would: a break introduced here would otherwise split every
block into slower pieces on the GPU, unnoticed. The blocks are compiled as ``apply_compile`` compiles
them (``Module.compile(fullgraph=True)``), with the cheap ``aot_eager`` backend: it runs dynamo and
AOTAutograd (the joint graph, AC's recomputation) without inductor's code generation, which is not
what this test checks. One in-process gloo rank gives FSDP2 its real hooks and DTensor parameters."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.distributed as dist

from workloads.pretrain.components.optim import build_optimizer
from workloads.pretrain.data.sampler import Windows
from workloads.pretrain.model.transformer import Transformer, TransformerBlock
from workloads.pretrain.parallel import fp8
from workloads.pretrain.parallel.parallelize import apply_ac, apply_fsdp
from workloads.pretrain.train import step_loss

EOS = 1  # the document mask's end-of-text token in the synthetic stream
SEQ, BATCH, STEPS = 64, 2, 3
# Identical blocks share one graph; the eval pass under no_grad traces a second (no autograd).
MAX_UNIQUE_GRAPHS = 2


@pytest.fixture(scope="module")
def dp_mesh(tmp_path_factory):
    """A 1-rank gloo process group in this process and FSDP's 1-D mesh over it."""
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.fail("a process group is already initialised in this process; run this file alone")
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
    finally:
        dist.destroy_process_group()


def compile_blocks(model: Transformer, fullgraph: bool = True) -> None:
    """``apply_compile`` with the aot_eager backend (see the module docstring)."""
    for block in model.layers.values():
        block.compile(fullgraph=fullgraph, backend="aot_eager")


def build(
    cfg, mesh, *, ac: str, fp8_recipe: str, param_dtype: torch.dtype, fullgraph: bool = True, edit=None
) -> Transformer:
    """``init_sharded``'s order (meta -> FP8 -> AC -> compile -> FSDP2 -> materialise), with FSDP
    applied on the 1-rank mesh, as ``parallelize`` does for one process too. ``edit`` changes
    the meta model before any of that."""
    with torch.device("meta"):
        model = Transformer(cfg.model)
    if edit is not None:
        edit(model)
    if fp8_recipe != "none":
        fp8.convert(model, fp8_recipe, fsdp=True)
    if ac != "none":
        apply_ac(model, ac)
    compile_blocks(model, fullgraph)
    apply_fsdp(model, mesh, param_dtype=param_dtype)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    return model


def batches(vocab: int, document_mask: bool):
    """The trainer's own windows (with ``data.document_mask``: positions and document ids per token)."""
    g = np.random.default_rng(0)
    tokens = g.integers(2, vocab, size=(STEPS + 1) * BATCH * SEQ + 1)
    tokens[::23] = EOS  # documents of 23 tokens: several per row, boundaries inside every window
    windows = Windows(tokens, SEQ, EOS if document_mask else None)
    return [windows.batch(range(i * BATCH, (i + 1) * BATCH), BATCH * SEQ, "cpu") for i in range(STEPS + 1)]


def train_and_eval(
    model: Transformer, cfg, *, autocast: bool, fp8_recipe: str, document_mask: bool, steps: int = STEPS
) -> None:
    """``steps`` optimizer steps as the trainer takes them (``step_loss``, FP8's post-step hook), then
    one validation pass (eval mode, no_grad)."""
    opt = build_optimizer(model, cfg.train)
    data = batches(cfg.model.vocab_size, document_mask)
    amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)
    for batch in data[:steps]:
        with amp:
            loss, _ = step_loss(model, batch, 1)
        loss.backward()
        opt.step()
        fp8.after_optimizer_step(model, fp8_recipe, fsdp=True)
        opt.zero_grad(set_to_none=True)
        assert torch.isfinite(loss.detach()).all()
    model.eval()
    with torch.no_grad(), amp:
        step_loss(model, data[-1], 1)
    model.train()


def dynamo_graphs(run: Callable[[], None]) -> int:
    """Run ``run`` from a clean dynamo state; fail on any graph break, whether raised (``fullgraph=True``)
    or counted (``fullgraph=False``); return the number of unique graphs compiled."""
    from torch._dynamo.exc import Unsupported, UserError
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    try:
        run()
    except (Unsupported, UserError) as exc:  # UserError: e.g. a branch on a data-dependent value
        pytest.fail(f"graph break in a compiled block (fullgraph=True raised): {str(exc).splitlines()[0]}")
    if counters["graph_break"]:
        pytest.fail(f"graph breaks in a compiled block: {dict(counters['graph_break'])}")
    return counters["stats"]["unique_graphs"]


CASES = [
    # (ac, fp8 recipe, bf16 autocast, FSDP param dtype, document mask)
    pytest.param("none", "none", True, torch.float32, False, id="ac-none-autocast"),
    pytest.param("selective", "none", True, torch.float32, True, id="ac-selective-autocast-mask"),
    pytest.param("full", "none", True, torch.float32, True, id="ac-full-autocast-mask"),
    pytest.param("selective", "none", False, torch.bfloat16, True, id="ac-selective-fsdp-bf16-mask"),
    pytest.param("selective", "tensorwise", True, torch.float32, True, id="fp8-tensorwise-ac-selective-mask"),
]


@pytest.mark.parametrize("ac, fp8_recipe, autocast, param_dtype, document_mask", CASES)
def test_blocks_compile_without_graph_breaks(
    dp_mesh, make_tiny_cfg, ac, fp8_recipe, autocast, param_dtype, document_mask
) -> None:
    if fp8_recipe != "none":
        pytest.importorskip("torchao.float8", reason="torchao not installed (pip install 'llmctl-train[fp8]')")
    cfg = make_tiny_cfg(**{"train.dtype": "bf16", "train.fp8": fp8_recipe})
    model = build(cfg, dp_mesh, ac=ac, fp8_recipe=fp8_recipe, param_dtype=param_dtype)

    graphs = dynamo_graphs(
        lambda: train_and_eval(model, cfg, autocast=autocast, fp8_recipe=fp8_recipe, document_mask=document_mask)
    )
    assert 1 <= graphs <= MAX_UNIQUE_GRAPHS, f"{graphs} unique graphs: a block recompiles"


class BreakingBlock(TransformerBlock):
    """A block whose forward does what dynamo cannot put in a graph: a ``print``, or a branch on a
    tensor's value read on the host (``.item()``)."""

    kind = "print"

    def forward(self, x, *args, **kwargs):
        if self.kind == "print":
            print("in the block")
        elif x.float().abs().max().item() < 0:
            x = x * 2
        return super().forward(x, *args, **kwargs)


@pytest.mark.parametrize(
    "fullgraph, kind",
    [(True, "print"), (True, "item"), (False, "item")],
    ids=["fullgraph-print", "fullgraph-item", "breaks-allowed-item"],
)
def test_the_check_fails_on_a_graph_break(dp_mesh, make_tiny_cfg, fullgraph: bool, kind: str) -> None:
    """The same helper catches a break however it surfaces: raised under ``fullgraph=True`` (what
    ``apply_compile`` uses) or only counted if a future compile drops ``fullgraph``."""
    cfg = make_tiny_cfg(**{"train.dtype": "bf16"})

    def break_first_block(model: Transformer) -> None:
        model.layers["0"].__class__ = BreakingBlock  # same parameters, one thing dynamo cannot trace
        model.layers["0"].kind = kind

    model = build(
        cfg,
        dp_mesh,
        ac="none",
        fp8_recipe="none",
        param_dtype=torch.float32,
        fullgraph=fullgraph,
        edit=break_first_block,
    )
    with pytest.raises(pytest.fail.Exception, match="graph break"):
        dynamo_graphs(
            lambda: train_and_eval(model, cfg, autocast=True, fp8_recipe="none", document_mask=False, steps=1)
        )
