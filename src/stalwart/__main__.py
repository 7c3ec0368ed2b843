"""`python -m stalwart ...` (so that `torchrun ... -m stalwart train` works)."""

from stalwart.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
