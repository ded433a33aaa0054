"""The run loop: builds the components of a recipe, places them, and runs GRPO steps."""
