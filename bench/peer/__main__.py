import sys

from bench.peer.cli import main

sys.exit(main())
