"""``python -m migd.sim``: see :mod:`migd.sim.cli`."""

import signal

from migd.sim.cli import main

# `python -m migd.sim list | head` should end quietly, not with a BrokenPipeError
# traceback (as migctl does)
signal.signal(signal.SIGPIPE, signal.SIG_DFL)
raise SystemExit(main())
