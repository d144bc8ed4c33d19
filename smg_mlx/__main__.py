from smg_mlx.cli import main

raise SystemExit(main())
