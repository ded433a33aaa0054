"""rlcore-fsdp2: a PyTorch-native (FSDP2 + DTensor) training backend for rlcore. See README.md."""
