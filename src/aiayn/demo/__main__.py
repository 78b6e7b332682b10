from aiayn.demo.corpus import main

raise SystemExit(main())
