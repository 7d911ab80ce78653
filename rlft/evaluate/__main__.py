"""python -m rlft.evaluate (see rlft.evaluate.cli)."""
import sys

from rlft.evaluate.cli import main

if __name__ == "__main__":
    sys.exit(main())
