"""``python -m workloads.command --config CFG --nproc-per-node N``: see ``guard``."""

import sys

from workloads.command.guard import main
from workloads.protocol.process_exit import exit_process

if __name__ == "__main__":
    exit_process(main(sys.argv[1:]))
