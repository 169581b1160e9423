from rag_opt.cli import main

raise SystemExit(main())
