"""``python -m greenroom.cli``: the ``greenroom`` command, as ``python -m greenroom`` is."""

import sys

from greenroom.cli.main import main

sys.exit(main())
