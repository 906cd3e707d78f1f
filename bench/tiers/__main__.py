import sys

from bench.tiers.cli import main

sys.exit(main())
