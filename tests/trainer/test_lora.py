"""LoRA and QLoRA (``model.lora.*``): PEFT on transformers' ``LlamaForCausalLM`` is the oracle.

The same Hugging Face checkpoint (a tiny Llama of test_hf_init's shape, saved in several shards) is loaded by
the trainer (``model.init_from``, its own code path) and by transformers; llmctl's adapter values are
copied into PEFT's, every B made nonzero so the adapters matter. Then, in fp32: the losses agree to
1e-5 and every adapter gradient to rtol 1e-4 / atol 1e-6 (the sums run in another order, nothing
else differs); the trainable-parameter count is PEFT's; at step 0 (B = 0) the loss is exactly the
base model's. QLoRA: the forward equals the same model whose target weights are the NF4-dequantized
ones, and differs from the fp32 model. FSDP on 2 gloo ranks and TP on 2 compute one process's loss
and adapter gradients; the trainer trains with activation checkpointing, gradient accumulation and
(QLoRA) FSDP exactly as one plain process does; compile (aot_eager) changes nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lora_worker import loss_and_grads, run_job, set_b
from test_hf_init import COMMON, OVERRIDES, _batch, _save

from workloads.pretrain.parallel.parallelize import ParallelDims

REPO = Path(__file__).resolve().parents[2]
# the model's linear -> PEFT's module under model.layers.N (transformers' Llama names)
PEFT_NAMES = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w2": "mlp.down_proj",
    "feed_forward.w3": "mlp.up_proj",
}
ALL = ["wq", "wk", "wv", "wo", "w1", "w2", "w3"]
# NF4 quantizes groups of 64 x 256 weights: a model whose every linear holds whole groups
NF4_SHAPE = dict(COMMON, hidden_size=256, intermediate_size=512)
LOSS_TOL, GRAD_RTOL, GRAD_ATOL = 1e-5, 1e-4, 1e-6
ONE_PROCESS = ParallelDims(1, 1, 1, 1)  # the layout of the models loaded in this process


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("lora")
    torch.manual_seed(0)
    return {
        "llama": _save(transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)), root / "llama"),
        "llama-256": _save(transformers.LlamaForCausalLM(transformers.LlamaConfig(**NF4_SHAPE)), root / "llama-256"),
    }


def _load(path: Path, *overrides: str):
    from workloads.pretrain.train import init_distributed, load_pretrained
    from workloads.protocol.config import load

    cfg = load(None, OVERRIDES + [f"model.init_from={path}", *overrides])
    return cfg, load_pretrained(cfg, init_distributed(cfg))


def _peft_name(fqn: str, ab: str) -> str:
    """``layers.0.attention.wq.lora_a.weight`` -> PEFT's
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight``."""
    _, n, module, linear, _, _ = fqn.split(".")
    return f"base_model.model.model.layers.{n}.{PEFT_NAMES[f'{module}.{linear}']}.lora_{ab}.default.weight"


def _peft(path: Path, targets: list[str], rank: int, alpha: float, adapters: dict[str, torch.Tensor]):
    """PEFT over transformers' model of ``path``, its adapters set to llmctl's (``adapters``: full values)."""
    import peft
    import transformers

    names = [PEFT_NAMES[k].split(".")[1] for k in PEFT_NAMES if k.split(".")[1] in targets]
    base = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model = peft.get_peft_model(
        base, peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=names, bias="none")
    )
    with torch.no_grad():
        for fqn, value in adapters.items():
            model.get_parameter(_peft_name(fqn, "A" if ".lora_a." in fqn else "B")).copy_(value)
    return model


def _full(model: torch.nn.Module, which=lambda name: True) -> dict[str, torch.Tensor]:
    from workloads.pretrain.model.init_weights import canonical_name

    out = {}
    for fqn, p in model.named_parameters():
        if which(canonical_name(fqn)):
            out[canonical_name(fqn)] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
    return out


@pytest.mark.parametrize("targets", [ALL, ["wq", "wv"]], ids=["attention+mlp", "q+v"])
def test_loss_and_adapter_gradients_are_pefts(checkpoints, one_process, targets: list[str]) -> None:
    from workloads.pretrain.model.lora import is_adapter, trainable_parameters
    from workloads.protocol.shape import lora_params

    cfg, model = _load(
        checkpoints["llama"], "model.lora.rank=4", "model.lora.alpha=8", f"model.lora.targets=[{','.join(targets)}]"
    )
    set_b(model)
    x, y = _batch()
    ours = loss_and_grads(model, x, y, ONE_PROCESS)
    theirs = _peft(checkpoints["llama"], targets, 4, 8, _full(model, is_adapter))
    logits = theirs(input_ids=x).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
    loss.backward()

    assert abs(float(ours["loss"]) - loss.item()) <= LOSS_TOL, (float(ours["loss"]), loss.item())
    assert len(ours["grads"]) == 2 * len(targets) * 2  # A and B of each target, 2 layers
    for fqn, grad in ours["grads"].items():
        peft_grad = theirs.get_parameter(_peft_name(fqn, "A" if ".lora_a." in fqn else "B")).grad
        assert grad.abs().max() > 0, fqn  # with B != 0 both A and B get gradients
        torch.testing.assert_close(grad, peft_grad, rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=fqn)
    trainable = theirs.get_nb_trainable_parameters()[0]
    assert trainable_parameters(model) == trainable == lora_params(cfg.model)


def test_adapters_keep_the_base_names_and_merge_into_one_weight(make_tiny_cfg) -> None:
    """On a materialised model (no mesh): adapters under each target's own name, only they train,
    and ``merged_weight`` is the one matrix that computes base plus adapters."""
    from workloads.pretrain.model import lora
    from workloads.pretrain.model.transformer import build_model
    from workloads.protocol.schema import LoraCfg

    cfg = make_tiny_cfg().model
    torch.manual_seed(0)
    model = build_model(cfg)
    spec = LoraCfg(rank=4, alpha=8.0)
    lora.apply(model, spec)
    set_b(model)
    trains = [n for n, p in model.named_parameters() if p.requires_grad]
    assert "layers.1.feed_forward.w2.lora_b.weight" in trains and all(lora.is_adapter(n) for n in trains)
    assert len(trains) == 2 * 7 * cfg.n_layers and not lora.is_adapter("layers.0.attention.wq.weight")
    for name in ("attention.wq", "feed_forward.w2"):
        linear = model.layers["0"].get_submodule(name)
        x = torch.randn(3, linear.in_features)
        merged = lora.merged_weight(linear.weight, linear.lora_a.weight, linear.lora_b.weight, lora.lora_scaling(spec))
        with torch.no_grad():
            torch.testing.assert_close(torch.nn.functional.linear(x, merged), linear(x))
            assert not torch.allclose(torch.nn.functional.linear(x, linear.weight), linear(x), atol=1e-4)


def test_step_zero_is_the_base_model(checkpoints, one_process) -> None:
    """PEFT's initial adapters (A uniform in +-1/sqrt(in), B = 0): the loss and logits are exactly
    the base model's, while A is not zero."""
    import math

    x, y = _batch()
    _, base = _load(checkpoints["llama"])
    _, lora = _load(checkpoints["llama"], "model.lora.rank=8")
    with torch.no_grad():
        assert torch.equal(lora(x), base(x)) and float(lora(x, y)) == float(base(x, y))
    for name, value in _full(lora, lambda n: "lora_" in n).items():
        if ".lora_b." in name:
            assert not value.any(), name
        else:
            bound = 1 / math.sqrt(value.shape[1])
            assert value.abs().max() <= bound and value.abs().max() > 0.9 * bound and value.std() > 0.4 * bound, name


def test_bf16_compute_holds_the_frozen_base_in_bf16_and_computes_what_fp32_masters_did(
    checkpoints, one_process, monkeypatch
) -> None:
    """Issue #51: in bf16 compute every frozen weight is stored in bf16 (half the base's memory, as
    PEFT holds it) and the adapters keep fp32 masters; since FSDP gathered bf16 copies of the fp32
    base before, the loss and every adapter gradient are bitwise those of the same model holding
    its base in fp32."""
    from workloads.pretrain.model import lora
    from workloads.pretrain.model.lora import is_adapter

    x, y = _batch()
    args = ("model.lora.rank=4", "model.lora.alpha=8", "train.dtype=bf16")
    _, held = _load(checkpoints["llama"], *args)
    dtypes = {name: p.dtype for name, p in held.named_parameters()}
    assert {d for n, d in dtypes.items() if is_adapter(n)} == {torch.float32}, dtypes
    assert {d for n, d in dtypes.items() if not is_adapter(n)} == {torch.bfloat16}, dtypes
    monkeypatch.setattr(lora, "hold_frozen_in", lambda model, dtype: None)  # the fp32 base, as before
    _, masters = _load(checkpoints["llama"], *args)
    assert {p.dtype for p in masters.parameters()} == {torch.float32}
    set_b(held)
    set_b(masters)
    ours, before = loss_and_grads(held, x, y, ONE_PROCESS), loss_and_grads(masters, x, y, ONE_PROCESS)
    assert torch.equal(ours["loss"], before["loss"]), (ours["loss"], before["loss"])
    assert ours["grads"].keys() == before["grads"].keys() and ours["grads"]
    for name, grad in ours["grads"].items():
        assert torch.equal(grad, before["grads"][name]), name


def test_a_tied_embedding_held_in_bf16_stays_one_parameter(make_tiny_cfg) -> None:
    """``hold_frozen_in`` replaces parameters: a weight two modules share (tied embeddings) becomes
    one bf16 parameter of both, not two copies."""
    from workloads.pretrain.model import lora
    from workloads.pretrain.model.transformer import Transformer
    from workloads.protocol.schema import LoraCfg

    with torch.device("meta"):
        model = Transformer(make_tiny_cfg(**{"model.tie_embeddings": True}).model)
    assert model.output.weight is model.tok_embeddings.weight
    lora.apply(model, LoraCfg(rank=4, alpha=8.0), compute_dtype=torch.bfloat16)
    assert model.output.weight is model.tok_embeddings.weight and model.output.weight.dtype == torch.bfloat16
    assert len(list(model.parameters())) == len({id(p) for _, p in model.named_parameters(remove_duplicate=False)})


def test_qlora_computes_the_dequantized_base_and_trains_only_adapters(checkpoints, one_process) -> None:
    from workloads.pretrain.components.optim import build_optimizer
    from workloads.pretrain.model import nf4
    from workloads.pretrain.model.init_weights import canonical_name
    from workloads.pretrain.model.lora import trainable_parameters
    from workloads.protocol.shape import lora_params

    x, y = _batch()
    path = checkpoints["llama-256"]
    cfg, quant = _load(path, "model.lora.rank=4", "model.lora.quantize_base=nf4")
    _, plain = _load(path, "model.lora.rank=4")
    set_b(quant)
    set_b(plain)
    with torch.no_grad():
        exact = plain(x)
        stored = dict(nf4.linears(quant))
        assert len(stored) == 2 * 7
        for fqn, linear in nf4.linears(quant):
            q = linear.weight
            assert q.quantized_data.numel() * 2 == q.numel()  # 4 bits a weight
            target = plain.get_submodule(fqn).weight
            target.to_local().copy_(nf4.dequantized(q).float())  # one rank: the local part is all of it
    got = loss_and_grads(quant, x, y, ONE_PROCESS)
    want = loss_and_grads(plain, x, y, ONE_PROCESS)
    with torch.no_grad():
        torch.testing.assert_close(quant(x), plain(x), rtol=1e-4, atol=1e-5)
        drift = (quant(x) - exact).abs().max()
    assert abs(float(got["loss"]) - float(want["loss"])) <= LOSS_TOL
    assert 1e-3 < drift < 0.5, drift  # 4 bits change the logits, a little
    for name, grad in got["grads"].items():
        torch.testing.assert_close(grad, want["grads"][name], rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=name)
    trains = {canonical_name(n) for n, p in quant.named_parameters() if p.requires_grad}
    assert trains == set(got["grads"]) and all(".lora_" in n for n in trains)
    optimizer = build_optimizer(quant, cfg.train)  # the adapters, and optimizer state for them alone
    held = [p for group in optimizer.param_groups for p in group["params"]]
    assert sum(p.numel() for p in held) == trainable_parameters(quant) == lora_params(cfg.model)
    optimizer.step()
    assert len(optimizer.state) == len(held) == len(trains)


@pytest.mark.slow
def test_fsdp_and_tp_compute_one_process_loss_and_gradients(checkpoints, one_process, tmp_path: Path) -> None:
    """LoRA and QLoRA on FSDP 2 (with full AC) and on TP 2 (gloo ranks, torchrun) against this
    process: the loss and every adapter's gradient (QLoRA under TP: the rowwise wo and w2 keep the
    whole NF4 weight, the colwise targets their rows of it, so the same quantized model)."""
    x, y = _batch()
    batch = tmp_path / "batch.pt"
    torch.save((x, y), batch)
    path = checkpoints["llama-256"]
    jobs = {
        "lora": [f"model.init_from={path}", "model.lora.rank=4", "model.lora.alpha=8"],
        "qlora": [f"model.init_from={path}", "model.lora.rank=4", "model.lora.quantize_base=nf4"],
    }
    ref = {name: run_job(OVERRIDES + overrides, x, y) for name, overrides in jobs.items()}
    fsdp, tp = ["parallel.dp_shard=2", "parallel.ac=full"], ["parallel.tp=2", "parallel.dp_shard=1"]
    for layout, names in ((fsdp, ["lora", "qlora"]), (tp, ["lora", "qlora"])):  # full AC: block 0's input needs no grad
        spec = [{"overrides": jobs[n], "out": str(tmp_path / f"{n}-{layout[0]}.pt")} for n in names]
        (tmp_path / "jobs.json").write_text(json.dumps(spec))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        cmd += [str(REPO / "tests" / "trainer" / "lora_worker.py"), str(batch), str(tmp_path / "jobs.json")]
        out = subprocess.run(cmd + OVERRIDES + layout, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        for name, job in zip(names, spec):
            got = torch.load(job["out"])
            assert abs(float(got["loss"]) - float(ref[name]["loss"])) <= LOSS_TOL, (layout, name)
            assert set(got["grads"]) == set(ref[name]["grads"])
            for fqn, grad in got["grads"].items():
                torch.testing.assert_close(
                    grad, ref[name]["grads"][fqn], rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=f"{layout} {name} {fqn}"
                )


def test_compiled_blocks_compute_what_eager_does(checkpoints, one_process, monkeypatch) -> None:
    """``model.compile`` with LoRA and QLoRA: blocks compile whole (fullgraph) and give eager's
    loss and gradients. The aot_eager backend runs dynamo and AOTAutograd without inductor's
    code generation (test_compile_fullgraph.py explains the choice)."""
    from workloads.pretrain.parallel import parallelize

    def aot_eager(model):
        for block in model.layers.values():
            block.compile(fullgraph=True, backend="aot_eager")

    x, y = _batch()
    path = checkpoints["llama-256"]
    for quantize in ("none", "nf4"):
        extra = ("model.lora.rank=4", f"model.lora.quantize_base={quantize}")
        _, eager = _load(path, *extra)
        set_b(eager)
        want = loss_and_grads(eager, x, y, ONE_PROCESS)
        torch._dynamo.reset()
        with monkeypatch.context() as patch:
            patch.setattr(parallelize, "apply_compile", aot_eager)
            _, compiled = _load(path, *extra, "model.compile=true")
        set_b(compiled)
        got = loss_and_grads(compiled, x, y, ONE_PROCESS)
        assert abs(float(got["loss"]) - float(want["loss"])) <= LOSS_TOL, quantize
        for name, grad in got["grads"].items():
            torch.testing.assert_close(grad, want["grads"][name], rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=name)


@pytest.mark.slow
def test_the_trainer_trains_adapters_alike_on_every_layout(workload, cache_dir, tmp_path: Path) -> None:
    """``python -m workloads.pretrain`` from its own initial weights: LoRA on one process, then on
    FSDP 2 with full activation checkpointing and 2 micro-batches per rank; QLoRA on one process,
    then on FSDP 2 with selective AC and micro-batches. Each pair logs the same losses."""
    from omegaconf import OmegaConf
    from test_parallel import SHORT, loss_env

    cfg = tmp_path / "config.yaml"
    OmegaConf.save(workload.cfg(**{"data.cache_dir": str(cache_dir), **SHORT, "train.steps": 4}), cfg)
    runs = {
        "lora": ["model.lora.rank=4"],
        "qlora": ["model.lora.rank=4", "model.lora.quantize_base=nf4", "model.dim=256", "model.hidden_dim=512"],
    }
    spread = {"lora": ["parallel.ac=full"], "qlora": ["parallel.ac=selective"]}
    for name, overrides in runs.items():
        losses = []
        for nproc, extra in ((1, []), (2, ["parallel.dp_shard=2", "train.micro_batch_size=2", *spread[name]])):
            out = tmp_path / f"{name}-{nproc}.jsonl"
            launcher = workload.torchrun(nproc) if nproc > 1 else None
            proc = workload.run(["--config", str(cfg), *overrides, *extra], loss_env(out), launcher=launcher)
            assert proc.returncode == 0, proc.stderr[-4000:]
            assert "pretrain | lora rank 4" in proc.stdout and "trainable of" in proc.stdout, proc.stdout
            losses.append(workload.loss_file(out))
        one, two = losses
        for kind in ("train", "val"):
            assert sorted(one[kind]) == sorted(two[kind]) and one[kind], (name, kind)
            for step, loss in one[kind].items():
                assert abs(two[kind][step] - loss) <= 1e-5, (name, kind, step, loss, two[kind][step])
        assert one["train"][4] < one["train"][1], name  # the adapters learn


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["model.lora.rank=-1"], "'model.lora.rank': must be >= 0"),
        (["model.lora.rank=4", "model.lora.alpha=0"], "'model.lora.alpha': must be > 0"),
        (["model.lora.rank=4", "model.lora.dropout=1.0"], "'model.lora.dropout': must lie in [0, 1)"),
        (["model.lora.rank=4", "model.lora.targets=[q_proj,wv]"], "['q_proj']: name the model's linears"),
        (["model.lora.quantize_base=nf4"], "but model.lora.rank=0 trains every weight"),
        (["model.lora.rank=4", "model.lora.quantize_base=nf4"], "but w1 holds 128 x 352 = 45056 weights"),
        (
            ["model.lora.rank=4", "model.lora.quantize_base=nf4", "model.dim=256", "model.hidden_dim=512"]
            + ["model.n_heads=8", "model.n_kv_heads=8", "parallel.tp=8"],
            "'parallel.tp': 8 TP ranks cannot split wq's NF4 weight (4 groups of 16384 weights)",
        ),
        (["model.lora.rank=4", "model.lora.dropout=0.1", "parallel.ac=selective"], "adapters' dropout would draw"),
        (["model.lora.rank=4", "train.fp8=rowwise", "train.dtype=bf16"], "FP8 with LoRA"),
    ],
    ids=["rank", "alpha", "dropout", "targets", "nf4-rank0", "nf4-groups", "nf4-tp", "dropout-ac", "fp8"],
)
def test_what_cannot_run_is_refused_naming_the_key(overrides: list[str], needle: str) -> None:
    from workloads.protocol.config import load
    from workloads.protocol.validate import ConfigError

    with pytest.raises(ConfigError) as err:
        load(None, overrides)
    assert needle in str(err.value) and "Fix: " in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_fsdp_must_split_whole_nf4_groups() -> None:
    from workloads.protocol.config import load
    from workloads.protocol.validate import ConfigError, resolve_layout

    cfg = load(None, ["model.lora.rank=4", "model.lora.quantize_base=nf4", "model.dim=256", "model.hidden_dim=512"])
    assert resolve_layout(cfg, 4)["dp_shard"] == 4  # q, k, v, o: 4 groups of 64 x 256 weights; MLP: 8
    with pytest.raises(ConfigError, match=r"'parallel.dp_shard': 8 FSDP ranks cannot split wq's NF4 weight"):
        resolve_layout(cfg, 8)
    tp = load(
        None,
        ["model.lora.rank=4", "model.lora.quantize_base=nf4", "model.dim=256", "model.hidden_dim=512"]
        + ["parallel.tp=2"],
    )
    assert resolve_layout(tp, 2)["tp"] == 2  # TP alone keeps the NF4 base out of FSDP
    with pytest.raises(ConfigError, match=r"'parallel.dp_shard': nf4 under tensor parallelism \(parallel.tp=2\)"):
        resolve_layout(tp, 4)


def test_llmctl_composes_the_lora_keys() -> None:
    """``llmctl plan experiment=smoke model.lora.rank=8`` composes (llmctl's root schema imports
    ModelCfg and its enums); a bad value is refused naming the key and what it accepts."""
    from llmctl.config.compose import compose
    from llmctl.errors import ConfigError
    from workloads.protocol.config import typed
    from workloads.protocol.schema import LoraCfg, QuantizeBase

    cfg = compose(["experiment=smoke", "model.lora.rank=8", "model.lora.targets=[wq,wv]"]).cfg
    want = {"rank": 8, "alpha": 16.0, "dropout": 0.0, "targets": ["wq", "wv"], "quantize_base": "none"}
    assert cfg["model"]["lora"] == want
    lora = typed(cfg).model.lora  # what llmctl's plan reads: the typed section, enums as members
    assert lora == LoraCfg(rank=8, targets=["wq", "wv"]) and lora.quantize_base is QuantizeBase.none
    with pytest.raises(ConfigError, match=r"model.lora.quantize_base.*none\|nf4"):
        compose(["experiment=smoke", "model.lora.rank=8", "model.lora.quantize_base=nf5"])
    with pytest.raises(ConfigError, match="model.lora.ranks"):
        compose(["experiment=smoke", "model.lora.ranks=8"])
