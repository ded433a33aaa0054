"""rlcore-envs: environments from the ecosystem (verifiers, OpenEnv, reasoning-gym) and a sandboxed code environment."""

__version__ = "0.1.0"
