"""``python -m dlserve.doctor``: the same as ``dlserve doctor``, without the server's imports."""

import sys

from dlserve.doctor.main import main

sys.exit(main())
