"""`python -m launch.cli ...`: the `xds-mpi` command."""

import sys

from launch.cli.main import main

sys.exit(main())
