"""phalanx.save / load: one codec, the fit checks of a saved state, atomic files."""
