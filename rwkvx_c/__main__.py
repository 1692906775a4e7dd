"""python -m rwkvx_c: the rwkvx-c command."""
import sys

from rwkvx_c.cli import main

sys.exit(main())
