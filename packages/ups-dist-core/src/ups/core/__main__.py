"""``python -m ups.core`` is the ``ups`` command."""

import sys

from .cli._main import main

sys.exit(main())
