from kvstored.cli import main

raise SystemExit(main())
