import sys

from bench.scale_out.cli import main

sys.exit(main())
