"""``python -m dplab VERB``: see :mod:`dplab.cli` (one module per verb)."""

import sys

from dplab.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
