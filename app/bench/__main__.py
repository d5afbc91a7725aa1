"""``python -m app.bench [flags]`` runs `sluice bench`; ``python -m app.bench sweep ...``
runs `sluice bench-sweep` (useful before the console script is installed)."""

import sys

from . import main, sweep_main

if sys.argv[1:2] == ["sweep"]:
    sys.exit(sweep_main(sys.argv[2:]))
sys.exit(main(sys.argv[1:]))
