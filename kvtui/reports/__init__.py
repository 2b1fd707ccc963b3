"""The headless commands, reading a run as the screens do: `bench`, the `tricks` table, the
simulator's reports (`sim`: work, budget, models, gpus) and the served ones (`served`: export-hf,
load)."""
