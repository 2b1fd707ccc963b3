"""One run, below the UI: the engine's own `process` and its one reader, the `summary` that folds
its events once (`serving` for a server's polls), and the `live` model the screens read."""
