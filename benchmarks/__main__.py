"""``python -m benchmarks`` (``make bench``): see benchmarks/__init__.py."""

import sys

from benchmarks.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
