"""``python -m xlaunch``: the same command as the ``xlaunch`` console script."""

import sys

from xlaunch.cli import main

sys.exit(main())
