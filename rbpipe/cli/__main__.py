"""``python -m rbpipe.cli``: the ``rbpipe`` command."""

import sys

from rbpipe.cli.commands import main

if __name__ == "__main__":
    sys.exit(main())
