"""Who may call and which values are accepted: MUNGE and TLS identity, authorisation, credential
binding, size and range bounds of what callers send."""
