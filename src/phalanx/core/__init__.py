"""The stack: Stack and its named surface, phalanx.stack(), in place, polyak, export, split, validation, memory."""
