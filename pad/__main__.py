"""``python -m pad``: the same command line as ``pad-decoding``."""
import sys

from .cli import main

sys.exit(main())
