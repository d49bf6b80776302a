"""``python -m migd`` runs the daemon."""

import sys

from migd.daemon.main import main

sys.exit(main())
