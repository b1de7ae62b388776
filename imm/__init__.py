"""IMM: Inference Management Module — instance ranks (Ray actors running the engine in lockstep), instances and their lifecycle, the standby pool, switchover handover."""
