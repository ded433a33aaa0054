"""Prompt, preference and image datasets, rows, reward functions and sequence packing; imports config, interfaces and the loading of shipped data files."""
