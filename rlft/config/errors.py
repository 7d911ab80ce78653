"""ConfigError, the one exception of a configuration mistake (its message names the key path).  Its own
module, so that every section module raises it without importing `rlft.config.schema`, which gathers them."""
from __future__ import annotations


class ConfigError(ValueError):
    """A configuration mistake; the message names the key path."""
