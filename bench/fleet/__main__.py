# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
from bench.fleet.cli import main

raise SystemExit(main())
