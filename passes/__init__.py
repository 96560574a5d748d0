"""fxmem's rewrite passes, one file a pass, installed as `fxmem.passes`."""
