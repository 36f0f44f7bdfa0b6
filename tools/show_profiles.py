"""Print the top functions of each cProfile dump in a folder (``DLSERVE_WORKER_PROFILE``,
``DLSERVE_SERVER_PROFILE``, ``core_path.py --profile DIR``).

    python tools/show_profiles.py DIR [N]
"""

import argparse
import pstats
from pathlib import Path

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("folder", type=Path, help="a folder of *.prof files")
parser.add_argument("top", type=int, nargs="?", default=25, help="functions per dump")
args = parser.parse_args()
for path in sorted(args.folder.glob("*.prof")):
    print(f"===== {path.name}")
    stats = pstats.Stats(str(path))
    stats.sort_stats("tottime").print_stats(args.top)
