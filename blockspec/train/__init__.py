"""Training the demo family: ``train-target`` (Nemotron-H) and ``train-draft`` (DFlash/DSpark)."""
