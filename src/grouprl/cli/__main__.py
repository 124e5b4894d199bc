"""`python -m grouprl.cli`: the `grouprl` command (accelerate launch runs it this way)."""

import sys

from grouprl.cli import main

sys.exit(main())
