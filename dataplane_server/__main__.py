"""``python -m dataplane_server ...`` is the ``dataplane`` command (see dataplane_server.cli)."""

import sys

from dataplane_server.cli import main

sys.exit(main())
