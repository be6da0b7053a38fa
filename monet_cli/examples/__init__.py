"""Small example models for monet, loaded as e.g. ``monet_cli.examples.models:tiny_gpt``."""
