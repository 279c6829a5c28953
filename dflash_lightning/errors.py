"""The error a bad setting raises, shared by the config and the parts that check their own settings, and how an error
line quotes what an outside server answered."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value that cannot work, named by its field."""


def first_line(answer: bytes | str, limit: int = 120) -> str:
    """What a server answered, for a one-line error: its first line cut to `limit` characters, quoted, followed by
    ' ...' where more was left out."""
    text = (answer.decode("utf-8", "replace") if isinstance(answer, bytes) else answer).strip()
    line = text.split("\n", 1)[0][:limit]
    return repr(line) + (" ..." if line != text else "")


__all__ = ["ConfigError", "first_line"]
