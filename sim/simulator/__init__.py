"""The simulator executor: a run of the engine priced by the cost model."""
