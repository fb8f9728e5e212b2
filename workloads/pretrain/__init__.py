"""Llama-style causal-LM pretraining: the workload llmctl ships and launches by default.

It imports nothing from llmctl: its contract with any launcher is a resolved YAML (``schema``,
``validate``, ``config``) and the environment, tags and exit codes in ``contract``.

Modules, one job each (docs/concepts.md has the whole map):
  schema, validate, config   the config it reads, its checks, and reading it
  contract                   environment, tags and exit codes shared with a launcher
  hardware, shape            peak FLOP/s per device; parameter and FLOP counts of a shape
  model, losses              the decoder (reference and fused paths); chunked fused CE
  parallelize, optim         TP -> AC -> compile -> FSDP2; AdamW and the LR schedule
  data/                      sources, tokenizer, token cache, sampler
  checkpoint, checkpoint_layout, preempt, budget   state that survives a stop
  metrics                    rank-0 metric sink, MFU, peak memory
  train                      the entry point: process group, build, parallelize, loop
  evaluate, generate, export_hf, prepare           the other entry points
"""
