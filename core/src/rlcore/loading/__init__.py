"""Loading a run's configuration: recipes (shipped or on disk) and dotted overrides into a RunConfig, through the plugins' sections; imports config and plugins."""
