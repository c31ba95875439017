"""The one exception of a configuration mistake (its own module so that every part of the config
package can raise it without importing the others)."""


class ConfigError(ValueError):
    """A mistake in the configuration a user can fix; the message says how."""
