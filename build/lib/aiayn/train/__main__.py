from aiayn.train.launch import main

raise SystemExit(main())
