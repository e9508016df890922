"""What a launch records and shows in the notebook: the history of its steps
(``tpunb.History``), the compile watch and its causes, the collective calls, device
memory, the live view and the history's figure."""
