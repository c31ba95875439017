"""Token sources and the layout-invariant batch loader."""
