"""``python -m dlserve``."""

import sys

from dlserve.cli import main

sys.exit(main())
