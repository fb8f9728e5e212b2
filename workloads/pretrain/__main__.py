"""``python -m workloads.pretrain`` / ``torchrun ... -m workloads.pretrain``."""

from workloads.pretrain.train import main
from workloads.protocol.process_exit import exit_process

if __name__ == "__main__":
    exit_process(main())
