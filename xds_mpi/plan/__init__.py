"""The deployment plan: topology and every check derived from the config."""
