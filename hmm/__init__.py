"""HMM: HBM Management Module — device memory, zero-copy handles, vpage-remap, p2p, planner, device workers and controller."""
