"""Shared configuration: the sharding vocabulary (`configs.sharding`), the checkpoint format
(`configs.checkpoint`), the command-line contract (`configs.cli`), the offline data sets both papers read
(`configs.datasets`) and the recipes, as data (`configs/sage/*.py`, `configs/pgla/*.py`: ConfigDicts that the
consuming package validates through `configs.schema`)."""
