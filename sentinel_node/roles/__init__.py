"""One module per node role (bootstrap, stage, verifier, trainer); ``common`` holds what they share."""
