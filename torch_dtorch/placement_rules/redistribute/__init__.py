"""Redistribute planning: :mod:`.planner` (the search for the cheapest step sequence between two placements, its
correctness rules in its docstring), :mod:`.steps` (the steps and their costs), :mod:`.simulate` (a plan applied to
per-rank tensors, for the reference run)."""
