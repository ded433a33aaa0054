"""rlcore-ddp: an example third-party rlcore training backend on ``torch.nn.parallel.DistributedDataParallel``."""

__version__ = "0.1.0"
