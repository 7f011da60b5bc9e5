"""The `rlhf` command (also the kubectl plugin kubectl-rlhf): what the base install gives (cli.py says which
commands need an extra)."""
