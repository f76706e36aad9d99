"""The command line: ``python -m lowgrad demo | doctor`` and the bandwidth measurement they share. May import every other layer."""
