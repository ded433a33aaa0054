"""The run: builds the parts of a recipe, places them, and runs the GRPO-family and offline loops through one skeleton; may import every package below testing and cli."""
