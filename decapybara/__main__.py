"""`python3 -m decapybara`: the `decapybara` command (`decapybara.cli.main`)."""

from decapybara.cli import main

raise SystemExit(main())
