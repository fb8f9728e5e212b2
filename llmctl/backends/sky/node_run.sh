set -euo pipefail
PY="${LLMCTL_PYTHON:-$HOME/.llmctl/venv/bin/python}"
NPROC="${LLMCTL_NPROC_PER_NODE:-$SKYPILOT_NUM_GPUS_PER_NODE}"
MASTER_ADDR="$(echo "$SKYPILOT_NODE_IPS" | head -n1)"
LLMCTL_CONFIG="$HOME/.llmctl/runs/$LLMCTL_RUN_ID/config.yaml"
exec "$PY" -m torch.distributed.run --nnodes="$SKYPILOT_NUM_NODES" --nproc_per_node="$NPROC" --node_rank="$SKYPILOT_NODE_RANK" --master_addr="$MASTER_ADDR" --master_port="${LLMCTL_MASTER_PORT:-29500}" -m workloads.pretrain --config "$LLMCTL_CONFIG"
