"""`python -m graphckpt`: the same program as the `graphckpt` command."""

import sys

from graphckpt.cli import main

if __name__ == "__main__":
    sys.exit(main())
