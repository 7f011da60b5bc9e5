"""A job's plan before anything runs: where its ranks go (placement) and what each GPU and worker pod holds
(memory). Arithmetic on the spec and the models' config.json, importing only the base install's packages: the
trainer plans with it before Ray starts, and `rlhf validate --gpu` with neither half installed."""
