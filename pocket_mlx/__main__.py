import sys

from pocket_mlx.cli.main import main

sys.exit(main())
