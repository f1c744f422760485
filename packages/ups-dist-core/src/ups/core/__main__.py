"""``python -m ups.core`` is the ``ups`` command."""

import sys

from .cli import main

sys.exit(main())
