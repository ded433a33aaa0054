"""Preference pairs for DPO and reward models: the ``preference`` dataset (JSONL / Parquet
through ``datasets``, ``chosen`` / ``rejected`` as text or chat messages) and the batch layout
the pairwise losses read (:mod:`rlcore.algorithms.pairs`). Importing this package imports no torch."""
