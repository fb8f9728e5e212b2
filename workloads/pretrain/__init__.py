"""Llama-style causal-LM pretraining: the workload llmctl ships and launches by default.

It imports nothing from llmctl: what it shares with any launcher is the protocol
(``workloads.protocol``: its config keys, checks and reading, the environment, tags, exit codes and
checkpoint layout) and the planner (``workloads.planner``: memory, schedule, peaks, split), both
torch-free and owned by no workload.

Its own folders (docs/concepts.md has the whole map):
  model/                     the decoder (reference and fused paths), losses, LoRA, NF4, sampling
  parallel/                  mesh, FP8 -> TP -> AC -> compile -> FSDP2
  data/                      sources, tokenizer, token cache, sampler
  checkpoint/                DCP checkpoints, Hugging Face weights in and out
  components/                optimizer, metrics, preemption, budget, in-training scores
  train                      the entry point and the Trainer
  evaluate, harness, score_tasks, prepare, dry_run   the other entry points
"""
