"""``python -m blockspec``: the same command line as ``blockspec``."""
import sys

from blockspec.cli import main

sys.exit(main())
