import sys

from bench.local_path.cli import main

sys.exit(main())
