"""``python -m attnroll.commands ...``: the ``attnroll`` command."""

import sys

from . import main

sys.exit(main())
