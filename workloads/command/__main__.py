"""``python -m workloads.command --config CFG --nproc-per-node N``: see ``guard``."""

import sys

from workloads.command.guard import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
