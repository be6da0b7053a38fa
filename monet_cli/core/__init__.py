"""Pure core of monet: data model, file formats, units, simulator and solver.

Nothing under this package imports torch, typer or rich, so it loads fast and can be
tested without a model.
"""
