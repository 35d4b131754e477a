"""The Faust stream worker: the node-keyed join of samples and allocations, and its rules."""
