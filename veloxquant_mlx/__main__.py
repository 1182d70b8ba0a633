from veloxquant_mlx.cli import main

raise SystemExit(main())
