"""``python -m migd.sim``: see :mod:`migd.sim.cli`."""

from migd.sim.cli import main

raise SystemExit(main())
