"""``python -m lowgrad demo | doctor``."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lowgrad", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    from lowgrad.cli import demo, doctor

    demo.add_arguments(sub.add_parser("demo", help="end-to-end gradient accumulation through every manager"))
    sub.add_parser("doctor", help="versions, library paths, GPUs and a kernel/NCCL smoke test")
    args = parser.parse_args(argv)
    if args.command == "demo":
        return demo.run(args)
    return doctor.run()


if __name__ == "__main__":
    sys.exit(main())
