"""llmctl: compose a config, plan where it runs, launch it, track it in MLflow."""

__version__ = "0.1.0"
