"""``python -m dlserve``."""

import sys

from dlserve.server.cli import main

sys.exit(main())
