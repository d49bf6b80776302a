"""``python -m migd.policysim``: see :mod:`migd.policysim.cli`."""

import signal

from migd.policysim.cli import main

# `python -m migd.policysim list | head` should end quietly, not with a BrokenPipeError
# traceback (as migctl does)
signal.signal(signal.SIGPIPE, signal.SIG_DFL)
raise SystemExit(main())
