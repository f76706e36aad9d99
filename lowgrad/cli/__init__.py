"""The command line (``lowgrad`` / ``python -m lowgrad``): the entry point (main), doctor, demo
and its report, and the bandwidth measurement they share. May import every other layer."""
