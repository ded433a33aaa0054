"""rlcore-toy-env: an example third-party rlcore plugin providing the ``toy_echo`` environment."""

__version__ = "0.1.0"
