"""Which FSDP2 unit holds the parameters outside the blocks, seen from the modules while a step runs.

``parallelize.apply_fsdp`` makes the embedding a unit of its own and [final norm, LM head] another
(untied embeddings), so neither is gathered while the blocks run: their modules then hold FSDP's
sharded DTensor parameters, and a gathered unit holds plain tensors. The head is gathered for the
loss and resharded after the norm's backward, before the blocks'. Tied embeddings stay in the root
unit, gathered through the whole step: the same check that passes untied fails there.

The trainer's one-process layout (``train.init_distributed``: a real gloo group of one, torn down
after each test): FSDP2 swaps sharded and gathered parameters at any world size. That the trained
losses still match one process's at every layout is tests/trainer/test_parallel.py's.
"""

from __future__ import annotations

import torch


def gathered_during_a_step(cfg) -> list[tuple[str, bool, bool]]:
    """(moment, embedding gathered, head gathered) at each block's forward and backward and at the
    loss, over one training step of the trainer's model."""
    from torch.distributed.tensor import DTensor

    from workloads.pretrain.train import init_distributed, init_sharded

    env = init_distributed(cfg)
    torch.manual_seed(0)
    model = init_sharded(cfg, env)
    seen = []

    def record(moment: str):
        def hook(*_):
            embedding, head = model.tok_embeddings.weight, model.output.weight
            seen.append((moment, not isinstance(embedding, DTensor), not isinstance(head, DTensor)))

        return hook

    for name, block in model.layers.items():
        block.register_forward_pre_hook(record(f"forward of layer {name}"))
        block.register_full_backward_pre_hook(record(f"backward of layer {name}"))
    model.output.register_forward_hook(record("loss"))  # after FSDP's own pre-forward: gathered by then
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 32))
    model(tokens, tokens).backward()
    assert all(isinstance(p, DTensor) for p in model.parameters())  # all resharded after the step
    return seen


def test_untied_embedding_and_head_are_sharded_while_the_blocks_run(one_process, make_tiny_cfg):
    seen = gathered_during_a_step(make_tiny_cfg())
    blocks = [(moment, emb, head) for moment, emb, head in seen if "layer" in moment]
    assert [moment for moment, _, _ in blocks] == [
        "forward of layer 0",
        "forward of layer 1",
        "backward of layer 1",
        "backward of layer 0",
    ]
    assert all(not emb and not head for _, emb, head in blocks), blocks
    assert ("loss", False, True) in seen, seen  # the head gathered for the loss, the embedding not


def test_tied_embeddings_stay_gathered_in_the_root_unit(one_process, make_tiny_cfg):
    seen = gathered_during_a_step(make_tiny_cfg(**{"model.tie_embeddings": True}))
    assert len(seen) == 5 and all(emb and head for _, emb, head in seen), seen
