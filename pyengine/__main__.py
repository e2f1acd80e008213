"""``python -m pyengine train ...``: see :mod:`pyengine.cli`."""
import sys

from . import _interrupted_while_starting

try:
    from .cli import main
except KeyboardInterrupt:  # as in the package's own imports (pyengine/__init__.py)
    _interrupted_while_starting()

if __name__ == "__main__":
    sys.exit(main())
