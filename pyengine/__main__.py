"""``python -m pyengine train ...``: see :mod:`pyengine.cli`."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
