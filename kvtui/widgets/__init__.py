"""Widgets that two or more screens use, each with its own DEFAULT_CSS."""
