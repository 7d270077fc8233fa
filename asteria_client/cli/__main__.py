"""``python -m asteria_client.cli``: the ``asteria`` command without its console script."""

import sys

from asteria_client.cli import main

sys.exit(main())
