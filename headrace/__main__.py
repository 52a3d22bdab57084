"""`python -m headrace ...` is the `headrace` command."""

from headrace.deploy.cli import main

if __name__ == "__main__":
    main()
