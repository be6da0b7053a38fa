"""Build the model, inputs, loss and optimizer of a training step from a spec."""
