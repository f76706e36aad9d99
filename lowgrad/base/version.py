"""The package version, defined once: ``lowgrad.__version__``, ``lowgrad --version`` and the
wheel's metadata (pyproject reads this attribute) all come from here."""

__version__ = "0.1.0"
