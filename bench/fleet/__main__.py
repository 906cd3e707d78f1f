# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
import sys

from bench.fleet.cli import main

sys.exit(main())
