"""Chunked fused linear + cross-entropy equals full-logits ``F.cross_entropy`` (loss and grads)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workloads.pretrain.model.losses import chunked_linear_cross_entropy, default_chunk_size

N, D, V = 37, 24, 101  # a prime token count: no chunk size below divides it


def inputs(ignore: bool = False, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g, requires_grad=True)
    w = (0.3 * torch.randn(V, D, generator=g)).requires_grad_()
    t = torch.randint(0, V, (N,), generator=g)
    if ignore:
        t[::3] = -100
    return h, w, t


def reference(h, w, t):
    return F.cross_entropy(h @ w.t(), t, ignore_index=-100)


@pytest.mark.parametrize("chunk_size", [1, 5, 16, N, 1000])
@pytest.mark.parametrize("ignore", [False, True], ids=["all-tokens", "ignore_index"])
def test_matches_full_logits(chunk_size, ignore):
    h, w, t = inputs(ignore)
    expected = reference(h, w, t)
    gh, gw = torch.autograd.grad(expected, (h, w))

    loss = chunked_linear_cross_entropy(h, w, t, chunk_size=chunk_size)
    ch, cw = torch.autograd.grad(loss, (h, w))
    torch.testing.assert_close(loss, expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ch, gh, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(cw, gw, atol=1e-6, rtol=1e-5)


def test_upstream_gradient_is_applied():
    h, w, t = inputs()
    gh, gw = torch.autograd.grad(2.5 * reference(h, w, t), (h, w))
    ch, cw = torch.autograd.grad(2.5 * chunked_linear_cross_entropy(h, w, t, chunk_size=8), (h, w))
    torch.testing.assert_close(ch, gh)
    torch.testing.assert_close(cw, gw)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_frozen_head_gets_no_gradient_and_the_same_hidden_gradient(autocast):
    """LoRA freezes the LM head: the loss then skips its weight gradient; the hidden one is unchanged."""
    h, w, t = inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        (expected,) = torch.autograd.grad(chunked_linear_cross_entropy(h, w, t, chunk_size=8), (h,))
        frozen = w.detach()
        loss = chunked_linear_cross_entropy(h, frozen, t, chunk_size=8)
    loss.backward()
    assert frozen.grad is None
    torch.testing.assert_close(h.grad, expected)


def test_batched_input_and_no_grad_path():
    h, w, t = inputs()
    hb, tb = h.detach().view(1, N, D), t.view(1, N)
    with torch.no_grad():
        loss = chunked_linear_cross_entropy(hb, w, tb, chunk_size=4)
    torch.testing.assert_close(loss, reference(h, w, t).detach())


def test_all_ignored_is_nan_like_cross_entropy():
    h, w, t = inputs()
    t[:] = -100
    assert torch.isnan(chunked_linear_cross_entropy(h, w, t, chunk_size=8))
    assert torch.isnan(reference(h, w, t))


def test_bf16_autocast_close_to_fp32():
    h, w, t = inputs()
    expected = reference(h, w, t)
    gh, gw = torch.autograd.grad(expected, (h, w))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = chunked_linear_cross_entropy(h, w, t, chunk_size=8)
    ch, cw = torch.autograd.grad(loss, (h, w))
    assert ch.dtype == h.dtype and cw.dtype == w.dtype
    assert abs(loss.item() - expected.item()) < 2e-2
    assert (ch - gh).norm() / gh.norm() < 2e-2
    assert (cw - gw).norm() / gw.norm() < 2e-2


def test_default_chunk_bounds_logits_memory():
    assert default_chunk_size(128_256) * 128_256 <= 1 << 25
    assert default_chunk_size(4096) == 8192
    assert default_chunk_size(4096, "cpu", tokens=65_536) == 256  # CPU ignores the micro-batch size


@pytest.mark.parametrize("vocab", [4096, 32_000, 128_256])
@pytest.mark.parametrize("tokens", [100, 2048, 8192, 8192 * 4, 131_072])
def test_gpu_chunks_are_few_and_multiples_of_128(vocab: int, tokens: int):
    """On CUDA every chunk re-reads and re-writes the whole fp32 [vocab, dim] weight gradient, so a
    micro-batch takes at most 8 of them, each a whole number of 128-token GEMM tiles."""
    chunk = default_chunk_size(vocab, "cuda", tokens)
    assert chunk % 128 == 0 and -(-tokens // chunk) <= 8, chunk
    assert chunk >= default_chunk_size(vocab, "cuda")  # never smaller than the memory-bound size
    assert default_chunk_size(128_256, "cuda", 8192) == 1024  # 1B at seq 8192: 8 chunks, not 32
    assert default_chunk_size(4096, "cpu") == 256  # 4 MiB of fp32 logits: stays in cache
    assert default_chunk_size(32_000, "cpu") == 256  # not 32: each chunk re-streams the [vocab, dim] grad
