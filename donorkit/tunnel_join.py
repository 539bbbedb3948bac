"""renamed to donorkit.commands.join_file in 0.18.0; kept so old scripts run"""

from donorkit.commands.join_file import main

if __name__ == "__main__":
    raise SystemExit(main())
