"""The package's version: a leaf module, so that any layer may read it without a cycle."""

__version__ = "0.1.0"
