"""Engine room (benchmarks): what the bulk bench measures ours against, in the same invocation: the talk's own table
and naive variants (talk_table.py, naive.py), a relay written by hand (handwritten.py), the produce-only and
read-only ceilings (ceilings.py), and the comparison tables (comparison.py)."""
