"""The EAGLE-3 drafter: config, modules, TTT attention, kernels."""
