"""High availability: the writer role the service watches and the ha CLI that sets it."""
