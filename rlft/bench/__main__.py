from rlft.bench.cli import main

raise SystemExit(main())
