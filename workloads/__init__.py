"""Training workloads that llmctl launches (``python -m workloads.pretrain`` under torchrun)."""
