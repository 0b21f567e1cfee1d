"""The package version, kept in one place (read by setup.py without importing the package)."""

__version__ = "0.1.0"
