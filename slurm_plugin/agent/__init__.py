"""The node agent: the per-node daemon that samples GPU memory for the jobs the prolog and epilog announce."""
