"""The protocol every workload speaks with its launcher, owned by no one workload: the environment it
reads, the MLflow tags it writes, its exit codes, where its checkpoints live and how its processes end.

The bundled trainer (``workloads.pretrain``) and a user's program under the command workload
(``workloads.command``) both speak it, and llmctl reads it; so it imports the standard library only
(fsspec for the checkpoint layout, omegaconf when a config file is read), never torch and never one
workload's code. The trainer's config keys and checks live here too: llmctl composes them and the
trainer reads them.
"""
