"""The fused kernel path against the plain-PyTorch oracle, and the FLOP/parameter accounting.

Tolerances (set from what torch's CPU kernels give, with a margin for rounding order):
  fp32:        logits and every parameter gradient within 1e-5 absolute + 1e-5 relative
  bf16 autocast: loss within 1e-3, gradient relative L2 within 1e-2
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from workloads.pretrain.model.transformer import Transformer, build_model
from workloads.protocol.config import typed
from workloads.protocol.schema import ModelCfg
from workloads.protocol.shape import ffn_hidden_dim, flops_per_token, num_params

VOCAB = 512
CONF = Path(__file__).resolve().parents[2] / "conf"


def shape(**kw) -> ModelCfg:
    base = dict(name="t", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, multiple_of=32, max_seq_len=64)
    base.update(kw)
    return typed({"model": base}).model


def pair(**kw) -> tuple[Transformer, Transformer]:
    """(reference, fused) models with identical weights."""
    torch.manual_seed(0)
    ref = build_model(shape(kernels="reference", **kw))
    fused = build_model(shape(kernels="fused", **kw))
    fused.load_state_dict(ref.state_dict())
    return ref, fused


def batch(seed: int = 1, b: int = 3, s: int = 40):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (b, s), generator=g), torch.randint(0, VOCAB, (b, s), generator=g)


def loss_and_grads(model: Transformer, x, y, autocast: bool = False):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(x, y)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "kw", [{}, {"n_kv_heads": 4}, {"n_kv_heads": 1}, {"tie_embeddings": True}], ids=["gqa-2", "mha", "mqa", "tied"]
)
def test_fused_matches_reference_fp32(kw):
    ref, fused = pair(**kw)
    x, y = batch()
    with torch.no_grad():
        torch.testing.assert_close(fused(x), ref(x), atol=1e-5, rtol=1e-5)
    loss_r, grads_r = loss_and_grads(ref, x, y)
    loss_f, grads_f = loss_and_grads(fused, x, y)
    torch.testing.assert_close(loss_f, loss_r, atol=1e-5, rtol=1e-5)
    assert grads_f.keys() == grads_r.keys()
    for name in grads_r:
        torch.testing.assert_close(grads_f[name], grads_r[name], atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("kw", [{}, {"tie_embeddings": True}], ids=["gqa", "tied"])
def test_fused_matches_reference_bf16_autocast(kw):
    ref, fused = pair(**kw)
    x, y = batch()
    loss_r, grads_r = loss_and_grads(ref, x, y, autocast=True)
    loss_f, grads_f = loss_and_grads(fused, x, y, autocast=True)
    assert abs(loss_f.item() - loss_r.item()) < 1e-3
    for name in grads_r:
        rel = (grads_f[name].float() - grads_r[name].float()).norm() / grads_r[name].float().norm()
        assert rel < 1e-2, (name, rel.item())
    # and bf16 stays close to the fp32 truth
    loss_32, _ = loss_and_grads(ref, x, y)
    assert abs(loss_f.item() - loss_32.item()) < 2e-2


def test_loss_equals_cross_entropy_of_logits():
    _, fused = pair()
    x, y = batch()
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(fused(x).flatten(0, 1), y.flatten())
        torch.testing.assert_close(fused(x, y), expected, atol=1e-5, rtol=1e-5)


def test_causal_prefix_invariance():
    """Logits at position t depend only on tokens <= t (mask and RoPE offsets are right)."""
    for model in pair():
        x, _ = batch(s=32)
        with torch.no_grad():
            full, prefix = model(x), model(x[:, :20])
        torch.testing.assert_close(full[:, :20], prefix, atol=1e-5, rtol=1e-5)


def test_module_names_are_the_parallelism_contract():
    model = build_model(shape())
    names = {n for n, _ in model.named_parameters()}
    for i in range(2):
        for leaf in (
            "attention.wq",
            "attention.wk",
            "attention.wv",
            "attention.wo",
            "feed_forward.w1",
            "feed_forward.w2",
            "feed_forward.w3",
            "attention_norm",
            "ffn_norm",
        ):
            assert f"layers.{i}.{leaf}.weight" in names
    assert {"tok_embeddings.weight", "norm.weight", "output.weight"} <= names
    assert "freqs_cos" not in model.state_dict()  # non-persistent: never checkpointed
    assert model.layers["0"].attention.wk.weight.shape == (2 * 16, 64)  # GQA: kv heads * head_dim


def test_attention_uses_local_head_count():
    """A TP rank holding half the heads (sharded wq/wk/wv/wo) still computes attention."""
    attn = build_model(shape()).layers["0"].attention
    half = torch.nn.Module()
    for n, dim in (("wq", 0), ("wk", 0), ("wv", 0), ("wo", 1)):
        w = getattr(attn, n).weight
        lin = torch.nn.Linear(1, 1, bias=False)
        lin.weight = torch.nn.Parameter(w.chunk(2, dim=dim)[0].clone())
        setattr(half, n, lin)
    attn.wq, attn.wk, attn.wv, attn.wo = half.wq, half.wk, half.wv, half.wo
    model = build_model(shape())
    out = attn(torch.randn(2, 8, 64), model.freqs_cos, model.freqs_sin)
    assert out.shape == (2, 8, 64)


def test_tied_embeddings_share_one_tensor_after_meta_build():
    model = build_model(shape(tie_embeddings=True))
    assert model.output.weight is model.tok_embeddings.weight
    untied = build_model(shape())
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in untied.parameters()) - VOCAB * 64


def test_init_is_deterministic_and_scaled():
    torch.manual_seed(3)
    a = build_model(shape())
    torch.manual_seed(3)
    b = build_model(shape())
    for (n, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), n
    assert abs(a.layers["0"].attention.wq.weight.std().item() - 0.02) < 0.002
    assert abs(a.layers["0"].attention.wo.weight.std().item() - 0.02 / 2) < 0.001  # 1/sqrt(2 * 2 layers)
    assert torch.equal(a.norm.weight, torch.ones(64))


def test_ffn_hidden_rule_matches_llama():
    assert ffn_hidden_dim(4096, 1024, 1.3) == 14336  # Llama-3.1-8B
    assert ffn_hidden_dim(2048, 256, 1.5) == 8192  # Llama-3.2-1B
    assert ffn_hidden_dim(64, 32, None) == 192  # int(2*4*64/3) = 170 -> 192


def test_num_params_and_flops_per_token_by_hand():
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelCfg), OmegaConf.load(CONF / "model/tiny.yaml")))
    model = build_model(cfg)
    d, L, V, H, Q, hidden = 64, 2, 4096, 4, 16, 192
    kv = 2 * Q
    per_layer = d * d + 2 * d * kv + d * d + 3 * d * hidden + 2 * d  # wq, wk+wv, wo, w1/w2/w3, 2 norms
    n = L * per_layer + d + V * d  # + final norm + output (the input embedding is excluded)
    counted = sum(p.numel() for p in model.parameters())  # the built module: the oracle for the formula
    assert counted == n + V * d
    assert num_params(cfg) == counted - model.tok_embeddings.weight.numel() == n
    assert num_params(cfg, exclude_embedding=False) == n + V * d
    T = 64
    assert flops_per_token(cfg, T) == 6 * n + 12 * L * H * Q * T
    assert flops_per_token(cfg, T) == 6 * 360_768 + 98_304  # 2,262,912


def test_meta_model_can_be_built_without_memory():
    with torch.device("meta"):
        big = Transformer(
            OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelCfg), OmegaConf.load(CONF / "model/8b.yaml")))
        )
    assert 7.4e9 < sum(p.numel() for p in big.parameters()) < 8.1e9


def test_rejects_sequences_longer_than_max_seq_len():
    model = build_model(shape(max_seq_len=16))
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.slow
def test_per_block_compile_keeps_names_and_numerics():
    """``model.compile`` compiles blocks in place: same FQNs (checkpoints) and same loss/grads."""
    from workloads.pretrain.model.transformer import apply_compile

    _, eager = pair()
    compiled = build_model(shape())
    compiled.load_state_dict(eager.state_dict())
    apply_compile(compiled)
    assert list(compiled.state_dict()) == list(eager.state_dict())
    x, y = batch()
    loss_e, grads_e = loss_and_grads(eager, x, y)
    loss_c, grads_c = loss_and_grads(compiled, x, y)
    torch.testing.assert_close(loss_c, loss_e, atol=1e-5, rtol=1e-5)
    for name in grads_e:
        torch.testing.assert_close(grads_c[name], grads_e[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("masked", [False, True], ids=["causal", "document-mask"])
def test_fused_attention_reads_grouped_kv_heads_without_copies(masked):
    """GQA on the fused path: SDPA gets the kv heads as they are (``enable_gqa``), not copies per
    query head (``repeat_kv``), on CPU with and without a mask; on CUDA ``native_gqa`` keeps the
    copies where the memory-efficient kernel may run (fp32, a mask)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from workloads.pretrain.model.transformer import native_gqa

    class KvHeads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen: list = []  # (query heads, kv heads) SDPA received

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "scaled_dot_product" in str(func):
                self.seen.append((args[0].shape[1], args[1].shape[1]))
            return func(*args, **(kwargs or {}))

    model = build_model(shape(n_heads=4, n_kv_heads=2))
    x, _ = batch()
    doc_ids = (torch.arange(x.shape[1]) // 16).expand_as(x) if masked else None
    with torch.no_grad(), KvHeads() as mode:
        model(x, doc_ids=doc_ids)
    assert mode.seen and set(mode.seen) == {(4, 2)}, mode.seen
    for dtype in (torch.float32, torch.bfloat16):  # CPU's flash kernel takes grouped heads, masked or not
        q = torch.zeros(1, dtype=dtype)
        assert native_gqa(q, None) and native_gqa(q, torch.zeros(1))


def test_native_gqa_on_cuda_only_where_flash_or_cudnn_can_run():
    from workloads.pretrain.model.transformer import native_gqa

    class Cuda:  # native_gqa reads only .device.type and .dtype
        def __init__(self, dtype):
            self.device, self.dtype = torch.device("cuda"), dtype

    assert native_gqa(Cuda(torch.bfloat16), None)
    assert not native_gqa(Cuda(torch.float32), None)  # memory-efficient kernel: no grouped heads
    assert not native_gqa(Cuda(torch.bfloat16), torch.zeros(1))  # a mask: efficient without cuDNN
