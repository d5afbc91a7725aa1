"""One module per weight format; each returns a `model.weights.LoadedModel`."""
