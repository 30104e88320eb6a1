"""`python -m openkernels.shared ...`: the `openkernels` command (see openkernels.shared.dev.cli)."""

import sys

from .dev.cli import main

sys.exit(main())
