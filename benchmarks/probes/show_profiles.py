"""Print the top functions of each cProfile dump in a folder (DLSERVE_WORKER_PROFILE,
DLSERVE_SERVER_PROFILE): ``python benchmarks/probes/show_profiles.py DIR [N]``."""

import pstats
import sys
from pathlib import Path

folder = Path(sys.argv[1])
top = int(sys.argv[2]) if len(sys.argv) > 2 else 25
for path in sorted(folder.glob("*.prof")):
    print(f"===== {path.name}")
    stats = pstats.Stats(str(path))
    stats.sort_stats("tottime").print_stats(top)
