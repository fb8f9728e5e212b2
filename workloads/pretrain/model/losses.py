"""Chunked fused linear + cross-entropy.

The LM head is the largest activation in a small-dim / large-vocab model: [tokens, vocab] logits
(plus their gradient) dwarf everything else (8B Llama, 8k tokens: 128k x 8k x 4 B = 4 GiB each).
Here the output projection and the loss run together, a chunk of tokens at a time, and the
gradients w.r.t. the hidden states and the output weight are produced in the same pass, so at most
one chunk of logits is alive. Backward only scales the stored gradients by the incoming grad.

Same idea as Liger-Kernel's fused linear cross-entropy and torchtitan's discussions of it; this
is a plain-PyTorch version that runs anywhere (CPU included).
"""

from __future__ import annotations

import torch

from workloads.planner.loss_chunk import default_chunk_size

IGNORE_INDEX = -100  # targets with this id take no loss (masked, padding, example boundaries)


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # The matmul honours an active autocast (bf16 on the GPU tensor cores); softmax math is fp32.
    return (h @ weight.t()).float()


def _chunk_loss(logits: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor):
    lse = torch.logsumexp(logits, dim=-1)
    target_logit = logits.gather(1, targets.clamp(min=0).unsqueeze(1)).squeeze(1)
    return ((lse - target_logit) * valid).sum(), lse


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Mean CE of ``hidden @ weight.T`` vs ``targets``; grads are computed during forward."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size: int, ignore_index: int, summed: bool):
        valid_all = targets != ignore_index
        one = torch.ones((), dtype=torch.float32, device=hidden.device)
        n_valid = one if summed else valid_all.sum().clamp(min=1).to(torch.float32)
        # Unclamped count so that "all tokens ignored" gives NaN, like F.cross_entropy.
        denom = one if summed else valid_all.sum().to(torch.float32)

        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden)
        # A frozen head (LoRA) needs no weight gradient: skipping it saves a third of the head's matmuls.
        weight_grad = ctx.needs_input_grad[1]
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if weight_grad else None

        autocast = torch.is_autocast_enabled(hidden.device.type)
        # All-fp32 (CPU training): write matmul results straight into the gradient buffers.
        plain = not autocast and hidden.dtype == weight.dtype == torch.float32
        for start in range(0, hidden.shape[0], chunk_size):
            h = hidden[start : start + chunk_size]
            t = targets[start : start + chunk_size].clamp(min=0)
            valid = valid_all[start : start + chunk_size].to(torch.float32)
            # log-softmax (one fused pass), then softmax = exp of it in place: 3 passes over the
            # chunk's logits in all, where logsumexp + (logits - lse).exp() makes twice as many.
            logprobs = torch.log_softmax(_chunk_logits(h, weight), dim=-1)
            loss_sum -= (logprobs.gather(1, t.unsqueeze(1)).squeeze(1) * valid).sum()

            # d(mean CE)/d(logits) = (softmax - onehot) / n_valid, zero on ignored rows.
            grad_logits = logprobs.exp_()
            grad_logits[torch.arange(t.shape[0], device=t.device), t] -= 1.0
            grad_logits *= (valid / n_valid).unsqueeze(1)

            if plain:
                torch.mm(grad_logits, weight, out=grad_hidden[start : start + chunk_size])
                if weight_grad:
                    grad_weight.addmm_(grad_logits.t(), h)
            else:
                g = grad_logits if autocast else grad_logits.to(h.dtype)
                grad_hidden[start : start + chunk_size] = (g @ weight).to(hidden.dtype)
                if weight_grad:
                    _add_weight_grad(grad_weight, g, h, autocast)

        ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype) if weight_grad else None)
        return loss_sum / denom

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight = ctx.saved_tensors
        grad_weight = None if grad_weight is None else grad_weight * grad_output
        return grad_hidden * grad_output, grad_weight, None, None, None, None


_OUT_DTYPE_MM = {"cuda": True}  # does this torch have CUDA's addmm(out_dtype=)? Learnt at first use.


def _add_weight_grad(grad_weight: torch.Tensor, g: torch.Tensor, h: torch.Tensor, autocast: bool) -> None:
    """``grad_weight += g.T @ h`` with a low-precision matmul and fp32 accumulation.

    On CUDA one ``addmm`` with ``out_dtype=float32`` adds the bf16 product straight into the fp32
    buffer (cuBLAS's beta=1), where ``+= (g.T @ h).float()`` also writes a bf16 [vocab, dim]
    product and its fp32 copy and then reads the buffer once more: about 3x the memory traffic per
    chunk. CPU has no ``out_dtype`` kernel, so it keeps the two-step form.
    """
    low = torch.get_autocast_dtype(h.device.type) if autocast else h.dtype
    if h.is_cuda and low in (torch.bfloat16, torch.float16) and _OUT_DTYPE_MM["cuda"]:
        try:
            with torch.autocast("cuda", enabled=False):  # autocast does not take out= ops
                torch.addmm(grad_weight, g.t().to(low), h.to(low), out_dtype=torch.float32, out=grad_weight)
            return
        except (NotImplementedError, TypeError):  # an older torch without the dtype overload
            _OUT_DTYPE_MM["cuda"] = False
    grad_weight += (g.t() @ h).float()


def _loss_only(hidden, weight, targets, chunk_size: int, ignore_index: int, summed: bool) -> torch.Tensor:
    """Evaluation path: same chunking, no gradient work."""
    valid_all = targets != ignore_index
    loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk_size):
        logits = _chunk_logits(hidden[start : start + chunk_size], weight)
        valid = valid_all[start : start + chunk_size].to(torch.float32)
        loss_sum += _chunk_loss(logits, targets[start : start + chunk_size], valid)[0]
    return loss_sum if summed else loss_sum / valid_all.sum().to(torch.float32)


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_size: int | None = None,
    ignore_index: int = IGNORE_INDEX,
    reduction: str = "mean",
) -> torch.Tensor:
    """Mean (or with ``reduction="sum"`` summed) cross-entropy of ``hidden @ weight.T`` against
    ``targets`` without full logits.

    hidden: [..., dim]; weight: [vocab, dim]; targets: [...] (int). Tokens whose target equals
    ``ignore_index`` are excluded, like ``F.cross_entropy``. Returns an fp32 scalar.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    summed = reduction == "sum"
    hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = targets.reshape(-1)
    if chunk_size is None:
        chunk_size = default_chunk_size(weight.shape[0], hidden.device.type, hidden.shape[0])
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _ChunkedLinearCrossEntropy.apply(hidden, weight, targets, chunk_size, ignore_index, summed)
    return _loss_only(hidden, weight, targets, chunk_size, ignore_index, summed)


def _chunk_token_losses(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(
        _chunk_logits(h, weight), targets, ignore_index=IGNORE_INDEX, reduction="none"
    )


def per_token_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, chunk_size: int | None = None
) -> torch.Tensor:
    """Each token's cross-entropy of ``hidden @ weight.T`` against ``targets`` ([..., dim] and [...]
    -> flattened [n], fp32, 0 where ``IGNORE_INDEX``) without full logits: a chunk of tokens at a time, each
    chunk's logits recomputed in backward (``torch.utils.checkpoint``) rather than kept. What DPO
    needs: a sum per sequence, whose gradient differs per sequence, which the fused kernel's
    scalar loss cannot carry."""
    from torch.utils.checkpoint import checkpoint

    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_t = targets.reshape(-1)
    if chunk_size is None:
        chunk_size = default_chunk_size(weight.shape[0], hidden.device.type, flat_h.shape[0])
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    parts = []
    for start in range(0, flat_h.shape[0], chunk_size):
        h, t = flat_h[start : start + chunk_size], flat_t[start : start + chunk_size]
        if grad:
            parts.append(checkpoint(_chunk_token_losses, h, weight, t, use_reentrant=False))
        else:
            parts.append(_chunk_token_losses(h, weight, t))
    return torch.cat(parts)
