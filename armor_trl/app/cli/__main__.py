"""``python -m armor_trl.app.cli``: the ``armor-trl`` command (as ``python -m armor_trl`` runs it)."""

import sys

from armor_trl.app.cli import main

if __name__ == "__main__":
    sys.exit(main())
