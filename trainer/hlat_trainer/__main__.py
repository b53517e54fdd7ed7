"""`python -m hlat_trainer` is `hlat-train` (torchrun launches it this way)."""

import sys

from hlat_trainer.cli import main

sys.exit(main())
