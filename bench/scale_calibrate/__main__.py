import sys

from bench.scale_calibrate.cli import main

sys.exit(main())
