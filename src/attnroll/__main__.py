"""``python -m attnroll ...``: the ``attnroll`` command (the same entry point as the console script)."""

from ._entry import main

main()
