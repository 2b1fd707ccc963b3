"""Training the shipped tiny model: the corpus reader and the training loop (never imported by the
app or the engines)."""
