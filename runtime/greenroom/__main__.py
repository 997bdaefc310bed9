"""``python -m greenroom``: the ``greenroom`` command."""

import sys

from greenroom.cli import main

sys.exit(main())
