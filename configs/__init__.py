"""Shared configuration: the sharding vocabulary (`configs.sharding`), the checkpoint format
(`configs.checkpoint`) and experiment configs (`configs/sage/*.py`, `configs/pgla/*.py`)."""
