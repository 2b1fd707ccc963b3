"""The lesson screens, one module per screen, named after what each teaches."""
