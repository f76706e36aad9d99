"""``python -m lowgrad``: the same command line as the ``lowgrad`` script (lowgrad.cli.main)."""
from lowgrad.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
