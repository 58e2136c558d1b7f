"""Errors raytrain raises on purpose."""


class ConfigError(ValueError):
    """A user-supplied setting is invalid; the message names the field, the value and the valid range."""
