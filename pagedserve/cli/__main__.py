"""`python -m pagedserve.cli ...`: the `pagedserve` command."""

import sys

from pagedserve.cli.main import main

sys.exit(main())
