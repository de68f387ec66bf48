"""``python -m armor_trl`` (and ``accelerate launch -m armor_trl train ...``): the ``armor-trl`` command."""

import sys

from armor_trl.app.cli import main

if __name__ == "__main__":
    sys.exit(main())
