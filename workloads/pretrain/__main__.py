"""``python -m workloads.pretrain`` / ``torchrun ... -m workloads.pretrain``."""

import sys

from workloads.pretrain.train import main

if __name__ == "__main__":
    sys.exit(main())
