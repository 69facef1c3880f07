"""`rl serve-api`: rl's trainer and inference servers behind the REST surface of the Tinker SDK."""
