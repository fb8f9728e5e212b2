"""Llama-style causal-LM pretraining: the workload llmctl ships and launches by default.

Modules, one job each:
  model    the decoder (reference and fused kernel paths), FLOPs and parameter counts
  losses   chunked fused linear + cross-entropy (never materialises [tokens, vocab] logits)
  data     the bundled corpus, BPE tokenizer, on-disk cache and the resumable sampler
  metrics  rank-0 metric sink (batched MLflow) and MFU peaks
  optim    AdamW parameter groups and the LR schedule
  train    the entry point: process group, build, parallelize seam, loop, checkpoint seam
"""
