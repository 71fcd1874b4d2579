"""The DFlash family's reference: the drafter, DFlash2's and DSpark's heads, the replayed flow."""
