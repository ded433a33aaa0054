"""Small, real environments of each ecosystem for the tests, recipes and docs (verifiers taskset, OpenEnv server)."""
