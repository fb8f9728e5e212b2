"""Run by test_liger_interpret.py in a fresh interpreter with TRITON_INTERPRET=1 (it must be set before
triton is imported, so not in the pytest process): the trainer's Liger loss (``_liger_fused_linear_ce``,
what ``fused_lm_loss`` calls for ``model.loss_kernel=liger``) against the chunked loss on the same fp32
inputs, forward and both gradients, for each reduction. Prints one JSON line per reduction."""

from __future__ import annotations

import json
import sys

import torch

from workloads.pretrain.model.losses import IGNORE_INDEX, chunked_linear_cross_entropy
from workloads.pretrain.model.transformer import _LIGER_PROBLEM, _liger_fused_linear_ce


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main(tokens: int, dim: int, vocab: int) -> None:
    g = torch.Generator().manual_seed(0)
    h0 = torch.randn(tokens, dim, generator=g)
    w0 = torch.randn(vocab, dim, generator=g) * dim**-0.5
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    targets[::7] = IGNORE_INDEX  # the trainer masks padding, prompts and document boundaries this way
    for reduction in ("sum", "mean"):
        liger = _liger_fused_linear_ce(reduction)
        if liger is None:
            raise SystemExit(f"liger-kernel did not load: {_LIGER_PROBLEM[reduction]}")
        results = {}
        for name in ("liger", "chunked"):
            h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
            if name == "liger":
                loss = liger(w, h, targets)  # Liger's argument order: weight first
            else:
                loss = chunked_linear_cross_entropy(h, w, targets, reduction=reduction)
            loss.backward()
            results[name] = (loss.detach(), h.grad, w.grad)
        (loss_l, gh_l, gw_l), (loss_c, gh_c, gw_c) = results["liger"], results["chunked"]
        record = {
            "reduction": reduction,
            "loss_liger": loss_l.item(),
            "loss_chunked": loss_c.item(),
            "rel_loss": abs(loss_l.item() - loss_c.item()) / abs(loss_c.item()),
            "rel_grad_h": rel(gh_l, gh_c),
            "rel_grad_w": rel(gw_l, gw_c),
            "grad_h_ignored_rows_zero": bool((gh_l[::7] == 0).all()),
        }
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main(*map(int, sys.argv[1:4]))
