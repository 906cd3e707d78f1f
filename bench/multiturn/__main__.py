import sys

from bench.multiturn.cli import main

sys.exit(main())
