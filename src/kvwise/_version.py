"""The one place kvwise's version is written (the package metadata reads it from here)."""

__version__ = "0.2.0"
