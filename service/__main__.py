from embedserve.runtime.cli import main

raise SystemExit(main())
