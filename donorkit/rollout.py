"""renamed to donorkit.commands.rollout in 0.18.0; kept so old scripts run"""

from donorkit.commands.rollout import main

if __name__ == "__main__":
    raise SystemExit(main())
