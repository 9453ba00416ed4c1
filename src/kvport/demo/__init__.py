"""The main job (``kvport demo``)."""
