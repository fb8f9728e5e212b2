"""Errors the CLI turns into exit codes instead of tracebacks."""


class ConfigError(Exception):
    """A config mistake the user can fix; the message says what and how. Exit code 3."""


class LaunchError(Exception):
    """The run could not be started or failed; the message says why. Non-zero exit."""
