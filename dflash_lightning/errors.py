"""The error a bad setting raises, shared by the config and the parts that check their own settings."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value that cannot work, named by its field."""


__all__ = ["ConfigError"]
