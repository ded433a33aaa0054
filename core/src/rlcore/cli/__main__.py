"""``python -m rlcore.cli``: the ``rlcore`` command, as its console script runs it."""

import sys

from rlcore.cli.commands import main

if __name__ == "__main__":
    sys.exit(main())
