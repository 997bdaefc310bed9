"""``python -m greenroom``: the ``greenroom`` command."""

import sys

from greenroom.cli.main import main

sys.exit(main())
