"""Injected by tests/e2e/test_fault_close.py (first on PYTHONPATH): Ctrl-C to the controller right
after it opened the run's first attempt in the ledger, before anything else of the attempt (its
status tag, the workload, the run's first line) exists. Test code: the product has no switch for it."""

import importlib.abc
import importlib.util
import os
import signal
import sys
import time

TARGET = "llmctl.cost.ledger"


class _AfterOpenAttempt(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):  # type: ignore[no-untyped-def]
            exec_module(module)
            opened = module.open_attempt

            def open_attempt(*args, **kwargs):  # type: ignore[no-untyped-def]
                n = opened(*args, **kwargs)
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(30)  # the handler raises here
                return n

            module.open_attempt = open_attempt

        spec.loader.exec_module = exec_and_patch
        return spec


sys.meta_path.insert(0, _AfterOpenAttempt())
