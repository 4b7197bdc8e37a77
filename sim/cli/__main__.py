"""`python -m kvsim.sim.cli ...` runs the `kvsim` command line (as the console script does)."""
from kvsim.sim.entry import main

main()
