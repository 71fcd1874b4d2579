"""The DFlash family's pure facts: what the reference models, DFlash2's lattice, DSpark's checks."""
