"""YAML -> frozen dataclasses: the schema, nothing derived."""
