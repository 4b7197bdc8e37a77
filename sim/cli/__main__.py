"""`python -m kvsim.sim.cli ...` runs the `kvsim` command line."""
from kvsim.sim.cli import main

main()
