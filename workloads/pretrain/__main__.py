"""``python -m workloads.pretrain`` / ``torchrun ... -m workloads.pretrain``."""

from workloads.pretrain.contract.process_exit import exit_process
from workloads.pretrain.train import main

if __name__ == "__main__":
    exit_process(main())
