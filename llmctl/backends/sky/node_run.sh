set -euo pipefail
PY="${LLMCTL_PYTHON:-$HOME/.llmctl/venv/bin/python}"
NPROC="${LLMCTL_NPROC_PER_NODE:-$SKYPILOT_NUM_GPUS_PER_NODE}"
# the first line of the node list, without a pipe: under pipefail, head closing the pipe early
# kills echo with SIGPIPE (exit 141) now and then
MASTER_ADDR="${SKYPILOT_NODE_IPS%%$'\n'*}"
# this node's own line of the list: where the other nodes reach it (its hostname may resolve elsewhere)
THIS_ADDR="$(sed -n "$((SKYPILOT_NODE_RANK + 1))p" <<< "$SKYPILOT_NODE_IPS")"
# the node must run the controller's llmctl, build and all (a shared-filesystem Python, or a venv
# kept from another launch, may hold another): said in the run's log, refused when it differs
# (from / : `python -m` puts the working directory first on the path, where an llmctl folder may lie)
HAVE="$(cd / && "$PY" -m llmctl --version 2>/dev/null || true)"
echo "llmctl on node ${SKYPILOT_NODE_RANK}: ${HAVE:-none}"
if [ "$HAVE" != "$LLMCTL_VERSION_LINE" ]; then
  echo "llmctl: node ${SKYPILOT_NODE_RANK} runs ${HAVE:-no llmctl}, the controller $LLMCTL_VERSION_LINE: not started." \
    "Fix: give infra.node_python the controller's llmctl, or leave it unset: the nodes then install the controller's wheel" >&2
  exit 3
fi
LLMCTL_CONFIG="$HOME/.llmctl/runs/$LLMCTL_RUN_ID/config.yaml"
# the contract's run folder (the resolved config.yaml), as on infra=local: every workload gets it
export LLMCTL_RUN_DIR="$HOME/.llmctl/runs/$LLMCTL_RUN_ID"
if [ "$SKYPILOT_NUM_NODES" -gt 1 ]; then
  # Several nodes: a hung collective is then told apart from a slow one only by these. On a
  # timeout every rank dumps its last collectives (torch's flight recorder, this many entries), and
  # NCCL says what broke. A value the user set wins.
  export TORCH_NCCL_DUMP_ON_TIMEOUT="${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}"
  export TORCH_NCCL_TRACE_BUFFER_SIZE="${TORCH_NCCL_TRACE_BUFFER_SIZE:-2000}"
  export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
fi
if [ "${LLMCTL_WORKLOAD:-pretrain}" = score ]; then
  # llmctl eval RUN --tasks on the run's infra: lm-eval on one checkpoint, one process, scores into the run
  exec "$PY" -m workloads.pretrain.score_tasks --config "$LLMCTL_CONFIG" ${LLMCTL_EVAL_PARALLELIZE:+--parallelize}
fi
if [ "${LLMCTL_WORKLOAD:-pretrain}" = command ]; then
  # a user's program (workload=command), from its launch directory, under its guard on every node
  cd "$HOME/.llmctl/runs/$LLMCTL_RUN_ID/program"
  exec "$PY" -m workloads.command --config "$LLMCTL_CONFIG" --nproc-per-node="$NPROC" --nnodes="$SKYPILOT_NUM_NODES" --node-rank="$SKYPILOT_NODE_RANK" --rdzv-endpoint="$MASTER_ADDR:${LLMCTL_MASTER_PORT:-29500}" --local-addr="$THIS_ADDR"
fi
exec "$PY" -m torch.distributed.run --nnodes="$SKYPILOT_NUM_NODES" --nproc_per_node="$NPROC" --node_rank="$SKYPILOT_NODE_RANK" --master_addr="$MASTER_ADDR" --master_port="${LLMCTL_MASTER_PORT:-29500}" -m workloads.pretrain --config "$LLMCTL_CONFIG"
