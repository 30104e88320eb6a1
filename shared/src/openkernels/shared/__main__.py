"""`python -m openkernels.shared ...`: the `openkernels` command (see openkernels.shared.cli)."""

import sys

from .cli import main

sys.exit(main())
