"""Cost models, pure: the time and requests of a save and a restore, and at cluster scale."""
