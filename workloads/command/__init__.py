"""Any training program under llmctl's run contract (``workload=command``).

The bundled trainer (``workloads.pretrain``) implements the contract itself; a user's own program
(a transformers ``Trainer`` script, a Lightning module, a torchrun loop) gets it from ``guard``,
which starts the program on each node and does for it what the trainer does for itself: record
the start in the MLflow run, stop the program before ``--max-cost`` is passed, and turn its exit
into the run's facts (preempted with state saved, budget stop). ``workloads.protocol.command`` is what
llmctl and the guard share (stdlib only: ``llmctl plan`` reads it without starting anything); docs/workloads.md is
the page a user's program is written against.
"""
