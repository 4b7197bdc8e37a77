"""The model of the hardware and the served model: catalog, cost model, memory sizing, engine defaults."""
