"""What a launch shows in the notebook: the compile watch and its causes, the collective
calls, device memory, the live view and the history's figure."""
