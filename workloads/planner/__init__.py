"""What a run will be, worked out from its config before anything runs, owned by no one process: the
model's shape and FLOPs, the memory a step needs per device, the LR schedule by step, the hardware's
peaks, the train/validation split, which lm-eval tasks a request names. ``llmctl plan`` and the trainer
both use it, so it imports the standard library only (lm-eval's task index when asked), never torch.
"""
