"""`python -m raytrain.cli ...`: the same as the `raytrain` console script."""

import sys

from raytrain.cli.main import main

sys.exit(main())
